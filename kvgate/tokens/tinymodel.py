"""Builds the project's tiny test model offline: byte-level BPE tokenizer, chat template, and
(where torch and transformers are installed, i.e. in the vLLM environment) random Llama weights.

The gateway and the simulator need only the tokenizer and template, so torch stays out of their
runtime. Everything is deterministic: the training corpus is generated from a fixed seed, and the
``tokenizers`` version is pinned by the project.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvgate.tokens.template_qwen3 import CHAT_TEMPLATE

BUILDER_VERSION = 1
"""Bump when the output changes, so cached builds are rebuilt."""

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or "
    "his from at which but have an they you were her she there been one all "
    "we their has would when if so no what can more will about up out them "
    "into some could time these two may then do first any my now such like "
    "other how its our over only new also after use way many well most work "
    "request response token cache prefix session worker gateway proxy model "
    "server client route affinity hash block memory latency throughput "
    "function tool call result weather city temperature search query answer "
    "think reason step user assistant system message content json python"
).split()

_EXTRA_TEXT = """def main(): return {"name": "get_weather", "arguments": {"city": "Paris"}}
You are a helpful assistant. Use the tools when they help answer the user.
import os, sys, json; print(json.dumps({"ok": true, "value": 42}))
<tool_call>{"name": "search", "arguments": {"query": "kv cache"}}</tool_call>"""


def build_corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(20000):
        n = rng.randint(4, 30)
        s = " ".join(rng.choice(WORDS) for _ in range(n))
        if rng.random() < 0.3:
            s = s.capitalize() + rng.choice([".", "?", "!", ","])
        if rng.random() < 0.1:
            s += " " + str(rng.randint(0, 100000))
        if rng.random() < 0.05:
            s = json.dumps({"name": rng.choice(WORDS), "arguments": {rng.choice(WORDS): rng.randint(0, 999)}})
        lines.append(s)
    lines.extend(_EXTRA_TEXT.splitlines())
    return lines


@dataclass(frozen=True)
class TokenSet:
    """The added tokens of a model's tokenizer and which of them are special.

    ``special`` follows the real model's tokenizer: engines strip special tokens from generated text
    and structured-output grammars cannot emit them, so a tag the model writes as text (Qwen3's
    ``<tool_call>``, DeepSeek's ``<｜tool▁calls▁begin｜>``) must be an added token that is not special.
    """

    tokens: tuple[tuple[str, bool], ...]
    """(content, special) in id order after the BPE alphabet's first ids."""
    eos: str = "<|im_end|>"
    pad: str = "<|endoftext|>"
    bos: str | None = None


TINY_TOKENS = TokenSet(tuple((t, True) for t in SPECIAL_TOKENS))
"""The tiny model's tokens (builder version 1: every added token special)."""


def build_tokenizer(out: Path, vocab: int = 8192, max_pos: int = 4096, seed: int = 0,
                    tokens: TokenSet = TINY_TOKENS, template: str = CHAT_TEMPLATE) -> int:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and the template.

    The BPE merges come from the same corpus and seed for every token set; only the added tokens
    (and so the ids after them) differ. Returns the vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    names = [t for t, _ in tokens.tokens]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=names,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = dict(tokens.tokens)
    if not all(special.values()):
        # The trainer marks every added token special; the real tokenizers do not.
        data = json.loads((out / "tokenizer.json").read_text())
        for entry in data["added_tokens"]:
            entry["special"] = special.get(entry["content"], True)
        (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": sp,
        }
        for t, sp in tokens.tokens
    }
    fixed = (tokens.pad, tokens.eos, tokens.bos)
    extra_special = [t for t, sp in tokens.tokens if sp and t not in fixed]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": extra_special,
        "bos_token": tokens.bos,
        "eos_token": tokens.eos,
        "pad_token": tokens.pad,
        "unk_token": None,
        "model_max_length": max_pos,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special_map: dict[str, object] = {
        "eos_token": tokens.eos,
        "pad_token": tokens.pad,
        "additional_special_tokens": extra_special,
    }
    if tokens.bos:
        special_map["bos_token"] = tokens.bos
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(template)
    return int(tok.get_vocab_size())


def build_weights(out: Path, hidden: int = 128, intermediate: int = 384, layers: int = 2, heads: int = 4,
                  kv_heads: int = 2, max_pos: int = 4096, seed: int = 0, dtype: str = "bfloat16") -> int:
    """Random Llama weights for the real engine; needs torch and transformers (vLLM's environment).

    Head dim 32 is the CPU attention backend's minimum. Returns the parameter count.
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    padded_vocab = ((vocab_size + 63) // 64) * 64
    cfg_tok = json.loads((out / "tokenizer_config.json").read_text())
    eos = tok.token_to_id(cfg_tok.get("eos_token") or "<|im_end|>")
    pad = tok.token_to_id(cfg_tok.get("pad_token") or "<|endoftext|>")
    bos = tok.token_to_id(cfg_tok["bos_token"]) if cfg_tok.get("bos_token") else pad
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=padded_vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=max_pos, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=pad, torch_dtype=dtype,
    )
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    gen = {"eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": True, "temperature": 0.7}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return int(sum(p.numel() for p in model.parameters()))


def default_model_dir() -> Path:
    base = os.environ.get("KVGATE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvgate"
    )
    return Path(base) / f"tiny-model-v{BUILDER_VERSION}"


def ensure_tiny_model(path: Path | None = None) -> Path:
    """The tokenizer assets at ``path`` (default: the user cache), built once if missing.

    Built into a temporary directory and renamed, so concurrent processes never read half a model.
    """
    target = path or default_model_dir()
    if (target / "tokenizer.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    build_tokenizer(tmp)
    try:
        tmp.rename(target)
    except OSError:
        # Another process won the race; its build is identical.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Build kvgate's tiny test model offline")
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--weights", action="store_true", help="also build random weights (needs torch)")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else default_model_dir()
    vocab = build_tokenizer(out)
    info: dict[str, object] = {"out": str(out), "vocab": vocab}
    if a.weights:
        info["params"] = build_weights(out)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
