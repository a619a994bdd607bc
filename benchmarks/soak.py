"""Soak: many waves of mixed requests through a real `safe-engine serve` process, watching whether it stays
the same size, keeps the same threads and answers everything.

Each wave sends `--clients` requests at once from one asyncio loop of httpx clients. The mix cycles through:
streams read to the end, plain requests, streams the client drops after two chunks (disconnect), requests
cancelled by the client after a short delay, malformed bodies (must be 400), seeded sampling, tools with
tool_choice (required / a named tool), response_format json_schema (strings bounded by maxLength), and stop
strings. After each wave the soak waits until /health reports no open request, then reads the server
process's resident memory (VmRSS) and thread count from /proc. At the end: open requests, every outcome's
count, SIGTERM and the exit status.

Targets (the report's "targets" say which hold): RSS after the last wave at most 10 % (or 100 MB) above RSS
after the second (of the measured waves, after any --warmup-waves); the thread count the same after every wave
from the second on; no hang, no 5xx, no open request.

python benchmarks/soak.py --tiny                                   # tiny random models
python benchmarks/soak.py --tiny --warmup-waves 2                  # as the CI test (tests/server/test_soak.py)
python benchmarks/soak.py --waves 5 --clients 64 --tokens 4 --max-batch-size 16 --out benchmarks/results/soak_demo.json
SAFE_ENGINE_TRIM_IDLE=0 python benchmarks/soak.py --tiny           # without giving memory back when idle
python benchmarks/soak.py --tiny --server-env MALLOC_ARENA_MAX=2   # settings for the server process only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]
KEY = "soak-key"
KINDS = (
    "stream",
    "bad",
    "plain",
    "disconnect",
    "sampling",
    "bad",
    "stream",
    "cancel",
    "tools",
    "bad",
    "json_schema",
    "stop",
    "disconnect",
    "plain",
    "bad",
    "cancel",
)  # fmt: skip  (a quarter are malformed bodies, an eighth each disconnect or cancel)
TOPICS = ["rainbows", "tides", "comets", "honey bees", "glaciers", "magnets", "volcanoes", "penguins"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
BAD_BODIES: list[bytes] = [
    b"{not json",
    b"[1, 2]",
    json.dumps({"messages": "hello"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(),
    json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}).encode(),
    b"",
]


def proc_status(pid: int) -> dict[str, float]:
    """The server's resident memory (MB) and thread count, from /proc."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mb"] = round(int(line.split()[1]) / 1024, 1)
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    return out


def tiny_model_dirs(root: Path) -> list[str]:
    """The tiny random members of the server tests (two tokenizer families), saved where `-m` can load them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.server.conftest import save_tiny_members

    return save_tiny_members(root)


def start_server(models: list[str], args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "safe_engine", "serve", "--port", "0", "--api-key", KEY]
    cmd += ["--max-batch-size", str(args.max_batch_size), "--max-new-tokens", str(args.tokens)]
    cmd += ["--stream-idle-timeout", "30"]
    for m in models:
        cmd += ["-m", m]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(dict(item.split("=", 1) for item in args.server_env))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("Serving "):
            return proc, line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
    raise SystemExit(f"the server exited before it was ready (status {proc.wait()})")


def request_body(kind: str, i: int, tokens: int, model: str) -> dict[str, Any]:
    """The JSON body of request `i` of its kind (every kind but "bad")."""
    messages = [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (request {i})."}]
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": tokens}
    if kind in ("stream", "disconnect", "cancel", "stop"):
        body["stream"] = kind != "cancel" or i % 2 == 0
    if kind == "sampling":
        body |= {"temperature": 0.8, "top_p": 0.9, "seed": i, "stream": i % 2 == 0}
    elif kind == "tools":
        choice = "required" if i % 2 else {"type": "function", "function": {"name": "get_weather"}}
        body |= {"tools": [WEATHER_TOOL], "tool_choice": choice, "max_tokens": 4 * tokens + 32}
    elif kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        body["max_tokens"] = 4 * tokens + 32
    elif kind == "stop":
        body["stop"] = ["e", "\n"]
    elif kind == "disconnect" or kind == "cancel":
        body["max_tokens"] = 4 * tokens  # long enough to be dropped mid-flight
    return body


async def streamed(res: httpx.Response, drop_after: int | None) -> str:
    """Read an SSE response: "ok", "disconnected" (dropped after `drop_after` chunks), or "error_event"."""
    chunks = 0
    async for line in res.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "ok"
        if "error" in json.loads(line[6:]):
            return "error_event"
        chunks += 1
        if drop_after is not None and chunks >= drop_after:
            return "disconnected"  # leaving the `async with` closes the connection
    return "truncated"  # the stream ended without [DONE]


async def one(client: httpx.AsyncClient, kind: str, i: int, tokens: int, model: str, hang_s: float) -> str:
    """Send request `i`; its outcome ("ok", "400", "5xx: ...", "hang", ...)."""
    url = "/v1/chat/completions"
    if kind == "bad":
        res = await client.post(
            url, content=BAD_BODIES[i % len(BAD_BODIES)], headers={"content-type": "application/json"}
        )
        return "400" if res.status_code == 400 else f"bad body answered {res.status_code}"
    body = request_body(kind, i, tokens, model)

    async def send() -> str:
        if not body.get("stream"):
            res = await client.post(url, json=body)
            if res.status_code >= 500:
                return f"5xx: {res.status_code} {res.text[:200]}"
            return "ok" if res.status_code == 200 else f"{res.status_code}: {res.text[:200]}"
        async with client.stream("POST", url, json=body) as res:
            if res.status_code != 200:
                text = (await res.aread()).decode()[:200]
                return f"5xx: {res.status_code} {text}" if res.status_code >= 500 else f"{res.status_code}: {text}"
            return await streamed(res, 2 if kind == "disconnect" else None)

    task = asyncio.ensure_future(send())
    if kind == "cancel":  # the client gives up mid-flight: the connection closes, the request is cancelled
        done, _ = await asyncio.wait({task}, timeout=0.05 + 0.01 * (i % 10))
        if not done:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return "cancelled"
        return f"finished before its cancel: {task.result()}"
    try:
        outcome = await asyncio.wait_for(task, hang_s)
    except TimeoutError:
        return "hang"
    if outcome == "ok" and kind in ("stream", "stop", "sampling", "tools", "json_schema", "plain"):
        return f"ok {kind}"
    return outcome


async def wave(url: str, model: str, start: int, clients: int, tokens: int, hang_s: float) -> Counter[str]:
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=hang_s + 30, limits=limits) as client:
        idx = range(start, start + clients)
        outcomes = await asyncio.gather(*(one(client, KINDS[i % len(KINDS)], i, tokens, model, hang_s) for i in idx))
    return Counter(outcomes)


def wait_idle(url: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health", timeout=30).json()
        if health["open_requests"] == 0 and health["running"] == 0 and health["waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def soak(models: list[str], args: argparse.Namespace) -> dict[str, Any]:
    proc, url = start_server(models, args)
    per_wave, outcomes = [], Counter[str]()
    started = time.perf_counter()
    try:
        model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
        model = model["data"][0]["id"]
        loaded = proc_status(proc.pid)
        for w in range(args.warmup_waves + args.waves):
            t0 = time.perf_counter()
            counts = asyncio.run(wave(url, model, w * args.clients, args.clients, args.tokens, args.hang_s))
            health = wait_idle(url)
            time.sleep(0.2)  # the scheduler's worker returns its memory as it ends
            status = proc_status(proc.pid)
            outcomes.update(counts)
            row = {
                "wave": w + 1 - args.warmup_waves,  # 0 and below: warm-up
                **status,
                "open_requests": health["open_requests"],
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            per_wave.append(row)
            print(f"wave {row['wave']}: {json.dumps(row)} {dict(counts)}", file=sys.stderr, flush=True)
        open_at_end = wait_idle(url)["open_requests"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()
    warmup, measured = per_wave[: args.warmup_waves], per_wave[args.warmup_waves :]
    rss = [row["rss_mb"] for row in measured]
    threads = [row["threads"] for row in measured]
    second, last = rss[min(1, len(rss) - 1)], rss[-1]
    bad_outcomes = {k: v for k, v in outcomes.items() if k.startswith("5xx") or k == "hang" or k == "truncated"}
    report = {
        "models": models,
        "waves": args.waves,
        "clients_per_wave": args.clients,
        "requests": (args.warmup_waves + args.waves) * args.clients,
        "warmup_waves": args.warmup_waves,
        "max_tokens": args.tokens,
        "max_batch_size": args.max_batch_size,
        "trim_when_idle": os.environ.get("SAFE_ENGINE_TRIM_IDLE", "1") not in ("0", "false", "no", "off"),
        "server_env": args.server_env,
        "rss_after_load_mb": loaded["rss_mb"],
        "rss_mb_after_warmup_waves": [row["rss_mb"] for row in warmup],
        "per_wave": measured,
        "rss_mb_per_wave": rss,
        "threads_per_wave": threads,
        "outcomes": dict(sorted(outcomes.items())),
        "open_requests_at_end": open_at_end,
        "exit_code": exit_code,
        "run_s": round(time.perf_counter() - started, 1),
    }
    report["targets"] = {
        # growth is what is checked: a heap the idle trim shrank below wave 2's size passes
        "rss_last_within_10pct_or_100mb_of_second": last - second <= max(0.10 * second, 100.0),
        "rss_last_minus_second_mb": round(last - second, 1),
        "threads_constant_from_second_wave": len(set(threads[1:])) <= 1,
        "no_hang_no_5xx": not bad_outcomes,
        "no_open_requests": open_at_end == 0,
        "clean_exit": exit_code == 0,
    }
    report["passed"] = all(v for k, v in report["targets"].items() if isinstance(v, bool))
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--tiny", action="store_true", help="serve the tests' tiny random models instead")
    p.add_argument("--waves", type=int, default=8, help="measured waves (default 8)")
    p.add_argument(
        "--warmup-waves",
        type=int,
        default=0,
        help="waves of the same mix before the measured ones, reported apart (default 0: the first wave is wave 1)",
    )
    p.add_argument("--clients", type=int, default=128, help="concurrent requests per wave (default 128)")
    p.add_argument("--tokens", type=int, default=6, help="max tokens of most requests (default 6)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS)")
    p.add_argument("--hang-s", type=float, default=120.0, help="a request unanswered this long is a hang")
    p.add_argument("--server-env", nargs="*", default=[], metavar="NAME=VALUE", help="extra env of the server")
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-models-") as tmp:
        models = tiny_model_dirs(Path(tmp)) if args.tiny else args.models
        report = soak(models, args)
    if args.tiny:
        report["models"] = ["tiny random: " + Path(m).name for m in models]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
