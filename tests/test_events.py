"""KV events leave the simulator in vLLM's ZMQ wire format, with the hashes kvgate computes."""

import asyncio
from pathlib import Path

import msgpack
import zmq
import zmq.asyncio

from kvgate.router.hashing import VllmHasher, event_int
from kvgate.serving import start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tokenizer import ChatTokenizer
from tests.conftest import free_port


async def test_events_published_and_replayable(model_dir: Path, tokenizer: ChatTokenizer) -> None:
    pub, rep = free_port(), free_port()
    w = SimWorker(SimSettings(model_dir=str(model_dir), speed=50, hash_seed="0", num_blocks=9,
                              kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                              kv_replay_endpoint=f"tcp://127.0.0.1:{rep}", kv_events_topic="kv"))
    h = await start_server(w.build_app())
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    await asyncio.sleep(0.3)  # PUB/SUB joins late; earlier messages would be dropped
    try:
        import httpx

        prompts = [list(range(1000 + 300 * i, 1000 + 300 * i + 300)) for i in range(4)]
        async with httpx.AsyncClient() as c:
            for p in prompts:
                r = await c.post(h.url + "/v1/completions", json={"model": "kvgate-tiny", "prompt": p,
                                                                  "max_tokens": 1})
                assert r.status_code == 200
        frames = []
        while await sub.poll(500):
            frames.append(await sub.recv_multipart())
        assert frames, "no events received"
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == list(range(len(seqs))) and all(f[0] == b"kv" for f in frames)
        events = [e for f in frames for e in msgpack.unpackb(f[2])[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        hasher = VllmHasher(128, seed="0")
        first = stored[0]
        assert first["parent_block_hash"] is None and first["block_size"] == 128 and first["medium"] == "GPU"
        assert first["block_hashes"] == [event_int(x) for x in hasher.block_hashes(prompts[0])]
        assert first["token_ids"] == prompts[0][:256]
        # 8 blocks of capacity, 2 per prompt plus a decode block: the later prompts evicted earlier ones.
        assert any(e["type"] == "BlockRemoved" for e in events)

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rep}")
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert await dealer.poll(2000), "replay did not finish"
            _, seq_b, payload = await dealer.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == -1:
                break
            replayed.append((seq, payload))
        assert [s for s, _ in replayed] == seqs[1:]
        assert [p for _, p in replayed] == [f[2] for f in frames[1:]]
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        await h.stop()
