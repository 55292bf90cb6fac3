"""The `kvgate` command as a newcomer meets it: its help, and its answers to bad or missing config."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvgate.cli import _build_parser, main
from tests.conftest import free_port


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command_in_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys)
    sub = next(a for a in _build_parser()._actions if a.dest == "cmd")
    commands = list(sub.choices)  # type: ignore[union-attr]
    assert len(commands) >= 6
    for cmd in commands:
        assert f"\n    {cmd} " in out, cmd
    assert "``" not in out and "session-aware gateway" in out


@pytest.mark.parametrize("cmd", ["serve", "sim"])
def test_every_option_has_help_with_its_default(capsys: pytest.CaptureFixture[str], cmd: str) -> None:
    out = _help(capsys, cmd)
    sub = next(a for a in _build_parser()._actions if a.dest == "cmd").choices[cmd]  # type: ignore[index]
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{cmd} {action.option_strings} has no help"
        if action.dest != "worker":
            assert "default" in action.help, f"{cmd} {action.option_strings}: no default in {action.help!r}"
    assert "{round_robin,least_loaded,session_affinity,cost_model}" in out or cmd == "sim"
    assert "{cpu-tiny,dynamo-mocker,h100-llama3-8b}" in out or cmd == "serve"


def _run_serve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", "serve"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})


@pytest.mark.parametrize(("env", "line"), [
    ({"KVGATE_WORKERS": "[{bad"}, "invalid configuration: KVGATE_WORKERS is not valid JSON: Expecting property"),
    ({"KVGATE_WORKERS": '[{"url": "ftp://x", "model": "m"}]'}, "invalid configuration:"),
])
def test_malformed_workers_json_is_one_line_and_exit_2(env: dict[str, str], line: str) -> None:
    r = _run_serve(env)
    assert r.returncode == 2
    assert r.stderr.startswith(line) and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2


def test_malformed_yaml_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "kvgate.yaml"
    bad.write_text("workers: [a\n  b: {")
    r = _run_serve({"KVGATE_CONFIG": str(bad)})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("invalid configuration: KVGATE_CONFIG: not valid YAML"), r.stderr


def test_serve_without_workers_warns_and_still_answers_health(spawn: Any) -> None:
    import httpx

    port = free_port()
    p = spawn("serve", "--port", str(port))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 503
    assert "WARNING kvgate: no workers configured" in p.tail()


def test_ctrl_c_stops_serve_cleanly(tmp_path: Path) -> None:
    import signal

    import httpx

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        # SIGINT as a terminal delivers it: a background job or nohup would have it ignored, inherited.
        p = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--port", str(port)], stdout=f,
                             stderr=subprocess.STDOUT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 130
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        p.kill()
        p.wait(timeout=10)


@pytest.mark.parametrize("which", ["serve --port", "sim --port", "serve --grpc-port", "epp --epp-port"])
def test_a_port_in_use_is_one_line_and_exit_2(which: str) -> None:
    import socket

    cmd, flag = which.split()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [cmd, flag, str(port)] + ([] if flag == "--port" else ["--port", str(free_port())])
        r = subprocess.run([sys.executable, "-m", "kvgate.cli", *argv], capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if " WARNING " not in ln]
    assert errors == [f"kvgate {cmd}: cannot listen on 127.0.0.1:{port}: Address already in use"], r.stderr


def test_serve_help_lists_every_setting_with_its_env_var_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgate.config import GatewaySettings

    out = " ".join(_help(capsys, "serve").split())
    names = [n for n in GatewaySettings.model_fields if n != "workers"]
    assert len(names) > 40
    for name in names:
        flag = "--" + name.replace("_", "-")
        assert f" {flag} " in out or f" {flag}, " in out, flag
        assert f"env KVGATE_{name.upper()})" in out, name
    assert "Bounded load: a worker above (1+epsilon)·mean load takes no more sessions. (default: 0.25;" in out
    assert "``" not in out


def test_every_generated_option_reaches_the_settings(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvgate.config import GatewaySettings
    from kvgate.settings_cli import overrides

    f = tmp_path / "kvgate.yaml"
    f.write_text("prefill: {min_gain_tokens: 64}\n")
    clean_env.setenv("KVGATE_CONFIG", str(f))
    args = _build_parser().parse_args([
        "serve", "--affinity-epsilon", "0.5", "--no-engine-token-ids", "--session-store", "redis",
        "--drain-timeout-s", "2.5", "--tokenizers", '{"m": "/models/m"}', "--prefill", '{"enabled": true}'])
    s = GatewaySettings(**overrides(args, GatewaySettings))
    assert (s.affinity_epsilon, s.engine_token_ids, s.session_store, s.drain_timeout_s) == (0.5, False, "redis", 2.5)
    assert s.tokenizers == {"m": "/models/m"}
    assert s.prefill.enabled and s.prefill.min_gain_tokens == 64  # merged into the file's section


def test_a_json_option_that_is_not_json_is_refused_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _build_parser().parse_args(["serve", "--tokenizers", "{m: x"])
    assert exc.value.code == 2
    assert "argument --tokenizers: not valid JSON" in capsys.readouterr().err


def _readme_recipe() -> list[list[str]]:
    """The kvgate commands of the README's "Running it for real" block, as argv lists."""
    import os
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Running it for real\n\n```bash\n(.*?)```", text, re.S)
    assert block is not None
    joined = block.group(1).replace("\\\n", " ")
    cmds = []
    for line in joined.splitlines():
        if line.startswith(".venv/bin/kvgate "):
            argv = shlex.split(os.path.expandvars(line), comments=True)
            cmds.append([a for a in argv if a != "&"][1:])
    return cmds


def test_the_readme_recipe_gives_expected_equal_to_cached_with_events_and_a_tokenizer(tmp_path: Path) -> None:
    import re

    import httpx

    from kvgate.serving import free_port as free
    from kvgate.tokens.tinymodel import ensure_tiny_model

    ensure_tiny_model()  # the recipe's tokenizers path: built by the first sim otherwise, racing the gateway
    cmds = _readme_recipe()
    assert [c[0] for c in cmds] == ["sim", "sim", "serve"]
    ports = {p: str(free()) for c in cmds for a in c for p in re.findall(r"(?<![\d.])(8\d{3}|5\d{3})(?!\d)", a)}

    def local(arg: str) -> str:
        return re.sub(r"(?<![\d.])(8\d{3}|5\d{3})(?!\d)", lambda m: ports[m.group(1)], arg)

    procs, logs = [], []
    try:
        # The gateway first: workers that come up after it (as a pasted block may) are still followed by
        # their KV events once they answer.
        deadline = time.monotonic() + 120
        for i, c in enumerate(sorted(cmds, key=lambda c: c[0] != "serve")):
            logs.append(tmp_path / f"{i}.log")
            with open(logs[-1], "wb") as f:
                procs.append(subprocess.Popen([sys.executable, "-m", "kvgate.cli", *map(local, c)], stdout=f,
                                              stderr=subprocess.STDOUT))
            while i == 0 and "asking for its KV events again" not in logs[0].read_text():
                assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
                time.sleep(0.1)
        url = f"http://127.0.0.1:{ports['8000']}"
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs[0].read_text()
            time.sleep(0.2)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent. " * 40},
                                      {"role": "user", "content": "hi"}]
        seen = []
        with httpx.Client(timeout=30) as h:
            for turn in range(3):
                r = h.post(url + "/v1/chat/completions", headers={"x-conversation-id": "demo"},
                           json={"model": "kvgate-tiny", "messages": msgs})
                assert r.status_code == 200, (r.status_code, r.text, logs[0].read_text()[-3000:])
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                seen.append((int(r.headers["x-kvgate-expected-cached-tokens"]), cached,
                             r.headers.get("x-kvgate-prefix-reuse")))
                m = r.json()["choices"][0]["message"]
                msgs += [{k: v for k, v in m.items() if v is not None}, {"role": "user", "content": f"then {turn}?"}]
            assert h.get(url + "/admin/conversations/demo/next-prefix").status_code == 200
        # /ready needs a healthy worker, not its KV events: those follow at the subscriber's next ask.
        while logs[0].read_text().count("following its KV events") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        gateway_log = logs[0].read_text()
        assert all(exp == got > 0 and reuse for exp, got, reuse in seen[1:]), (seen, gateway_log)
        # (Its workers' first checks failed, it started before them: warned as it should be.)
        assert "MISMATCH" not in gateway_log and "approximate mode" not in gateway_log, gateway_log
        assert gateway_log.count("following its KV events") == 2, gateway_log
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
