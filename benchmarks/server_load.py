"""Latency and throughput of `safe-engine serve` under 1 / 4 / 16 concurrent streaming clients, side by side
with the same requests sent to the in-process engine from as many threads.

For each concurrency level c, c clients each send one streaming chat request (distinct questions, greedy,
at most --tokens tokens) at the same moment. Reported per level and path: time to the first content delta
(median and max over the c requests), total time per request (median, max), the wall time of the level,
and throughput (tokens of all c requests / wall time). The server runs in its own process (as users run
it), the clients are one asyncio loop of httpx; the in-process path runs after the server has stopped, so
the two never compete for the CPU. Each path gets one warm-up request first. Whether every server reply
equals the in-process reply to the same request is checked too (greedy decoding is deterministic).

With `--variants`, the same server then also serves what some clients ask for, side by side in that run
(each pair measured twice in alternating order, medians reported): 4 clients with one choice each against
one client asking for `n=4` (the same number of choices), and 4 clients without and with `logprobs`
(`top_logprobs=5`): the cost of reporting each token's distribution.

python benchmarks/server_load.py                               # demo models, 48 tokens, 1/4/16 clients
python benchmarks/server_load.py --tokens 24 --concurrency 1 4 --out benchmarks/results/server_load.json
python benchmarks/server_load.py --concurrency 4 --variants --out benchmarks/results/server_load_variants.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx

from safe_engine.bench import print_json

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]
TOPICS = [
    "rainbows", "volcanoes", "honey bees", "the moon", "tides", "snowflakes", "thunder", "coral reefs",
    "photosynthesis", "magnets", "earthquakes", "comets", "deserts", "penguins", "glaciers", "lightning",
]  # fmt: skip
KEY = "bench-key"


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} to a child in three sentences."}]


def summary(runs: list[dict], wall: float) -> dict:
    ttft = [r["first_token_s"] for r in runs]
    total = [r["total_s"] for r in runs]
    tokens = sum(r["tokens"] for r in runs)
    return {
        "requests": len(runs),
        "tokens": tokens,
        "first_token_s": {"median": round(statistics.median(ttft), 3), "max": round(max(ttft), 3)},
        "total_s": {"median": round(statistics.median(total), 3), "max": round(max(total), 3)},
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(tokens / wall, 3),
    }


# -- through the server ----------------------------------------------------------------------------------------
def start_server(models: list[str], max_batch_size: int, tokens: int, threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "safe_engine", "serve", "--port", "0", "--api-key", KEY]
    cmd += ["--max-batch-size", str(max_batch_size), "--max-new-tokens", str(tokens)]
    for m in models:
        cmd += ["-m", m]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("Serving "):
            return proc, line.split(" at ", 1)[1].split()[0]
    raise SystemExit(f"the server exited before it was ready (status {proc.wait()})")


async def one_stream(client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int, **fields) -> dict:
    body = {"model": model, "messages": question(i), "max_tokens": tokens, "stream": True, **fields}
    body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    first, text, used = None, "", 0
    async with client.stream("POST", f"{url}/chat/completions", json=body) as res:
        res.raise_for_status()
        async for line in res.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for choice in chunk["choices"]:  # several with n > 1: the first choice's text is kept
                delta = choice["delta"].get("content") or ""
                if delta and first is None:
                    first = time.perf_counter() - started
                text += delta if choice["index"] == 0 else ""
            if not chunk["choices"] and chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - started
    return {"first_token_s": first if first is not None else total, "total_s": total, "tokens": used, "text": text}


async def server_level(url: str, model: str, c: int, tokens: int, **fields) -> tuple[dict, list[str]]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=3600, limits=httpx.Limits(max_connections=64)) as client:
        started = time.perf_counter()
        runs = await asyncio.gather(*(one_stream(client, url, model, i, tokens, **fields) for i in range(c)))
        wall = time.perf_counter() - started
    return summary(runs, wall), [r["text"] for r in runs]


def run_server(args: argparse.Namespace) -> tuple[dict, dict[int, list[str]]]:
    proc, url = start_server(args.models, args.max_batch_size, args.tokens, args.threads)
    try:
        model = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()["data"][0][
            "id"
        ]
        asyncio.run(server_level(url, model, 1, 4))  # warm-up
        results, texts = {}, {}
        for c in args.concurrency:
            results[str(c)], texts[c] = asyncio.run(server_level(url, model, c, args.tokens))
            print(f"server, {c} clients: {json.dumps(results[str(c)])}", file=sys.stderr)
        if args.variants:
            results["variants"] = run_variants(url, model, args.tokens)
        return results, texts
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


VARIANTS = {  # name -> (clients, extra request fields)
    "4 clients, n=1": (4, {}),
    "1 client, n=4": (1, {"n": 4}),
    "4 clients, logprobs off": (4, {}),
    "4 clients, logprobs on (top 5)": (4, {"logprobs": True, "top_logprobs": 5}),
}


def run_variants(url: str, model: str, tokens: int) -> dict:
    """Each pair of `VARIANTS` side by side on one server, twice in alternating order; medians and ratios."""
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for first, second in zip(names[::2], names[1::2]):
        for order in ((first, second), (second, first)):
            for name in order:
                clients, fields = VARIANTS[name]
                result, _ = asyncio.run(server_level(url, model, clients, tokens, **fields))
                runs[name].append(result)
                print(f"server, {name}: {json.dumps(result)}", file=sys.stderr)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    out: dict = {name: {"throughput_tok_s": median(name, "throughput_tok_s"), "runs": runs[name]} for name in runs}
    out["n=4 over 4 clients (throughput)"] = round(
        median(names[1], "throughput_tok_s") / median(names[0], "throughput_tok_s"), 3
    )
    out["logprobs on over off (throughput)"] = round(
        median(names[3], "throughput_tok_s") / median(names[2], "throughput_tok_s"), 3
    )
    return out


# -- in process ------------------------------------------------------------------------------------------------
def inprocess_level(ens, c: int, tokens: int) -> tuple[dict, list[str]]:
    runs: list[dict | None] = [None] * c
    barrier = threading.Barrier(c)

    def work(i: int) -> None:
        barrier.wait()
        started = time.perf_counter()
        first = None
        stream = ens.stream(messages=question(i), max_new_tokens=tokens)
        for delta in stream:
            if delta and first is None:
                first = time.perf_counter() - started
        total = time.perf_counter() - started
        runs[i] = {
            "first_token_s": first if first is not None else total,
            "total_s": total,
            "tokens": stream.result.stats.tokens,
            "text": stream.result.text,
        }

    threads = [threading.Thread(target=work, args=(i,)) for i in range(c)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    done = [r for r in runs if r is not None]
    return summary(done, wall), [r["text"] for r in done]


def run_inprocess(args: argparse.Namespace) -> tuple[dict, dict[int, list[str]]]:
    import torch

    from safe_engine import Ensemble

    torch.set_num_threads(args.threads)
    ens = Ensemble.from_pretrained(args.models, max_batch_size=args.max_batch_size)
    ens.generate(messages=question(0), max_new_tokens=4)  # warm-up
    results, texts = {}, {}
    for c in args.concurrency:
        results[str(c)], texts[c] = inprocess_level(ens, c, args.tokens)
        print(f"in-process, {c} clients: {json.dumps(results[str(c)])}", file=sys.stderr)
    return results, texts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--tokens", type=int, default=48, help="max tokens per request (default 48)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-batch-size", type=int, default=16, help="the server's and the engine's (default 16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--variants", action="store_true", help="also n=4 vs 4 clients and logprobs on vs off")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)

    started = time.perf_counter()
    server, server_texts = run_server(args)
    inprocess, inprocess_texts = run_inprocess(args)
    report = {
        "models": args.models,
        "tokens_per_request": args.tokens,
        "max_batch_size": args.max_batch_size,
        "torch_threads": args.threads,
        "cpu_count": os.cpu_count(),
        "server": server,
        "in_process": inprocess,
        "server_over_in_process": {  # the levels both paths ran (not the server's variants)
            str(c): {
                "first_token": round(
                    server[str(c)]["first_token_s"]["median"] / inprocess[str(c)]["first_token_s"]["median"], 3
                ),
                "throughput": round(server[str(c)]["throughput_tok_s"] / inprocess[str(c)]["throughput_tok_s"], 3),
            }
            for c in args.concurrency
        },
        "same_text_as_in_process": {str(c): server_texts[c] == inprocess_texts[c] for c in args.concurrency},
        "run_s": round(time.perf_counter() - started, 1),
    }
    print_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
