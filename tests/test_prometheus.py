"""The dashboard and the rules in deploy/observability/ against a real Prometheus.

A gateway with simulated vLLM workers serves agent traffic (tool calls, streamed answers, new user
turns, several tenants, an abandoned stream, an unroutable prompt, a worker that dies); Debian's
Prometheus scrapes it every second and evaluates the rules. Then every dashboard panel's query, every
recording rule and the query part of every alert must return data, and every rule must evaluate
cleanly. ``promtool`` checks the rule files and runs their unit tests (when each alert fires).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import yaml

from tests.conftest import MODEL, Cluster, free_port
from tests.helpers import model_dir_with_config

OBS = Path(__file__).resolve().parent.parent / "deploy" / "observability"
RULE_FILES = sorted((OBS / "rules").glob("*.yml"))
DASHBOARDS = sorted((OBS / "dashboards").glob("*.json"))
TRAFFIC_S = 20.0
RATE_WINDOW = "1m"
"""What ``$__rate_interval`` stands for here: covers all the traffic, as Grafana's would on a live fleet."""


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("KVGATE_PROMETHEUS_TESTS") == "0":
            pytest.skip(f"{name} not installed and KVGATE_PROMETHEUS_TESTS=0")
        pytest.fail(f"{name} not found: apt-get install prometheus (.ci/run does), or KVGATE_PROMETHEUS_TESTS=0")
    return path


def promtool(*args: str) -> str:
    r = subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_rule_files_pass_promtool_and_their_unit_tests() -> None:
    assert RULE_FILES and DASHBOARDS
    out = promtool("check", "rules", *map(str, RULE_FILES))
    assert out.count("SUCCESS") == len(RULE_FILES)
    assert "SUCCESS" in promtool("test", "rules", str(OBS / "rules" / "tests" / "kvgate-alerts.test.yml"))
    # Every alert has a unit test that sees it fire.
    tested = set(re.findall(r"alertname: (\w+)", (OBS / "rules" / "tests" / "kvgate-alerts.test.yml").read_text()))
    assert {r["alert"] for _, r in rules() if "alert" in r} <= tested


def rules() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in RULE_FILES:
        for g in yaml.safe_load(f.read_text())["groups"]:
            out += [(g["name"], r) for r in g["rules"]]
    return out


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables set as "All" and the rate window) of every panel."""
    out = []
    for f in DASHBOARDS:
        dash = json.loads(f.read_text())
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        for p in dash["panels"]:
            if p["type"] == "row":
                continue
            assert p["datasource"]["uid"] == "${datasource}", p["title"]  # provisioned into any Prometheus
            assert p.get("targets"), p["title"]
            for t in p["targets"]:
                expr = t["expr"].replace("$__rate_interval", RATE_WINDOW)
                for name, v in variables.items():
                    if v["type"] == "query":
                        expr = expr.replace(f"${name}", v["allValue"])
                assert "$" not in expr, (p["title"], expr)
                out.append((p["title"], expr))
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """(name, series selector, label) of every ``label_values(selector, label)`` dashboard variable."""
    out = []
    for f in DASHBOARDS:
        variables = json.loads(f.read_text())["templating"]["list"]
        for v in variables:
            if v["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
            assert m, v
            selector = m.group(1)
            for other in variables:
                if other["type"] == "query":
                    selector = selector.replace(f"${other['name']}", other["allValue"])
            out.append((v["name"], selector, m.group(2)))
    return out


def alert_query(expr: str) -> str:
    """The query an alert compares with its threshold (each alert is `<query> <op> <number>`)."""
    m = re.fullmatch(r"(?s)\s*(.*\S)\s*(?:>=|<=|==|!=|>|<)\s*[0-9.]+\s*", expr)
    assert m, f"alert expression not of the form `<query> <op> <threshold>`: {expr}"
    return m.group(1)


def start_prometheus(tmp_path: Path, url: str) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([binary("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address={url[7:]}",
                             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


@contextlib.asynccontextmanager
async def prometheus(tmp_path: Path, gateway: str, workers: list[str]) -> AsyncIterator[str]:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(f) for f in RULE_FILES],
        "scrape_configs": [{"job_name": "kvgate", "static_configs": [{"targets": [gateway]}]},
                           {"job_name": "workers", "static_configs": [{"targets": workers}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    proc, log = start_prometheus(tmp_path, url)
    try:
        async with httpx.AsyncClient() as h:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                with contextlib.suppress(httpx.HTTPError):
                    if (await h.get(url + "/-/ready", timeout=1)).status_code == 200:
                        break
                assert time.monotonic() < deadline, "prometheus not ready in 30 s"
                await asyncio.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def query(h: httpx.AsyncClient, url: str, expr: str) -> list[float]:
    r = await h.get(url + "/api/v1/query", params={"query": expr})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    res = body["data"]["result"]
    if body["data"]["resultType"] == "scalar":
        return [float(res[1])]
    return [float(s["value"][1]) for s in res]


# -- traffic ---------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search",
                                            "parameters": {"type": "object", "properties": {}}}}]


async def agent(h: httpx.AsyncClient, url: str, name: str, tenant: str | None, until: float) -> int:
    """An agent loop until ``until``: a tool call, its result, a streamed answer, a new user turn; a new
    conversation every three user turns (the tiny model's context is 4k tokens)."""
    headers = {"x-tenant-id": tenant} if tenant else {}
    n = conv = 0
    while time.monotonic() < until:
        conv += 1
        cid = f"{name}-{conv}"
        msgs: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {name}. " * 40},
                                      {"role": "user", "content": f"task {cid}"}]
        for turn in range(3):
            if time.monotonic() >= until:
                break
            body = {"model": MODEL, "messages": msgs, "tools": TOOLS, "sim": {"tool_calls": 1, "reasoning_tokens": 30}}
            try:
                r = await h.post(url + "/v1/chat/completions", json=body, headers={"x-conversation-id": cid, **headers})
            except httpx.HTTPError:
                continue
            if r.status_code != 200:
                continue  # a worker died under it: the next turn goes elsewhere
            m = {k: v for k, v in r.json()["choices"][0]["message"].items() if v is not None}
            msgs += [m, {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": f"result {turn} " * 30}]
            answer: dict[str, Any] = {"role": "assistant", "content": "", "reasoning": ""}
            body = {"model": MODEL, "messages": msgs, "tools": TOOLS, "stream": True,
                    "sim": {"tool_calls": 0, "reasoning_tokens": 40, "answer_tokens": 20}}
            with contextlib.suppress(httpx.HTTPError):
                async with h.stream("POST", url + "/v1/chat/completions", json=body,
                                    headers={"x-conversation-id": cid, **headers}) as s:
                    async for line in s.aiter_lines():
                        if line.startswith("data: {"):
                            for ch in json.loads(line[6:]).get("choices") or []:
                                for k in ("content", "reasoning"):
                                    answer[k] += (ch.get("delta") or {}).get(k) or ""
            msgs += [{k: v for k, v in answer.items() if v}, {"role": "user", "content": f"next {turn}"}]
            n += 2
    return n


async def abandon_a_stream(h: httpx.AsyncClient, url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "stream": True,
            "sim": {"reasoning_tokens": 3000}}
    async with h.stream("POST", url + "/v1/chat/completions", json=body) as s:
        async for line in s.aiter_lines():
            if '"reasoning"' in line:
                return  # walks away mid-stream


async def kill_a_worker_under_a_session(h: httpx.AsyncClient, c: Cluster) -> None:
    """A worker dies with a session homed on it; that session's next turn meets it before anything else
    does (the gateway finds out from the failure, and retries elsewhere)."""
    victim = f"127.0.0.1:{c.sims[1][1].port}"
    # Several blocks of history, so the turn that meets the dead worker has cached prefix to lose (the
    # KvgateCacheLost alert's series): a one-line conversation is shorter than a block and loses nothing.
    # Each probe's history is its own from the first token: a shared system prompt would draw every probe
    # to the worker that cached it, and none would land on the victim.
    rules = " ".join(f"rule {n}: answer briefly and cite the file you read." for n in range(12))
    for i in range(50):
        msgs = [{"role": "system", "content": f"probe {i}. {rules}"}, {"role": "user", "content": "probe"}]
        r = await h.post(c.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4},
                         headers={"x-conversation-id": f"probe-{i}"})
        if r.headers["x-kvgate-worker"] == victim:
            break
    else:
        raise AssertionError("no conversation was placed on the second worker")
    await c.sims[1][1].stop()
    msgs += [{k: v for k, v in r.json()["choices"][0]["message"].items() if v is not None},
             {"role": "user", "content": "again"}]
    r = await h.post(c.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4},
                     headers={"x-conversation-id": f"probe-{i}"})
    assert r.status_code == 200 and r.headers["x-kvgate-worker"] != victim


async def traffic(c: Cluster) -> int:
    until = time.monotonic() + TRAFFIC_S
    async with httpx.AsyncClient(timeout=30) as h:
        agents = [asyncio.ensure_future(agent(h, c.url, f"{t or 'anon'}{i}", t, until))
                  for t in ("acme", "globex", None) for i in range(2)]
        await asyncio.sleep(TRAFFIC_S * 0.3)
        await abandon_a_stream(h, c.url)
        # A batch of prompts has no /tokenize equivalent: routed on an estimate.
        r = await h.post(c.url + "/v1/completions", json={"model": MODEL, "prompt": ["a b", "c d"], "max_tokens": 2})
        assert r.status_code < 500  # the simulator judges a batch itself
        await asyncio.sleep(TRAFFIC_S * 0.3)
        await kill_a_worker_under_a_session(h, c)
        done = await asyncio.gather(*agents)
    return sum(done)


async def test_every_panel_and_rule_returns_data_from_a_real_prometheus(make_cluster: Any, model_dir: Path,
                                                                        tmp_path: Path) -> None:
    # Active health checks only at start: the dead worker is found by the request that meets it.
    c = await make_cluster(2, events=True, tokenizers={MODEL: str(model_dir_with_config(model_dir, tmp_path / "m"))},
                           health_interval_s=60.0)
    hostport = c.url.removeprefix("http://")
    workers = [h.url.removeprefix("http://") for _, h in c.sims]
    async with prometheus(tmp_path, hostport, workers) as prom, httpx.AsyncClient(timeout=10) as h:
        requests = await traffic(c)
        assert requests > 50
        await asyncio.sleep(3)  # the last scrapes and rule evaluations
        missing: list[str] = []
        for title, expr in panel_queries():
            if not any(math.isfinite(v) for v in await query(h, prom, expr)):
                missing.append(f"panel {title!r}: {expr}")
        for _, r in rules():
            if "record" in r:
                for expr in (r["expr"], r["record"]):  # the expression, and what Prometheus recorded from it
                    if not any(math.isfinite(v) for v in await query(h, prom, expr)):
                        missing.append(f"recording rule {r['record']}: {expr}")
            else:
                await query(h, prom, r["expr"])  # the whole alert expression is valid PromQL
                if not any(math.isfinite(v) for v in await query(h, prom, alert_query(r["expr"]))):
                    missing.append(f"alert {r['alert']}: {alert_query(r['expr'])}")
        for name, selector, label in variable_queries():
            r = await h.get(prom + f"/api/v1/label/{label}/values", params={"match[]": selector})
            if not r.json()["data"]:
                missing.append(f"dashboard variable ${name}: label_values({selector}, {label})")
        assert not missing, "no data:\n" + "\n".join(missing)
        loaded = (await h.get(prom + "/api/v1/rules")).json()["data"]["groups"]
        evaluated = [(r["name"], r["health"], r.get("lastError", "")) for g in loaded for r in g["rules"]]
        assert len(evaluated) == len(rules())
        assert all(health == "ok" for _, health, _ in evaluated), evaluated
