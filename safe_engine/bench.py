"""Speed benchmark: every configuration side by side in one run, with the ratios' floors.

Per member m, measured here in the same process: t_m, the per-token time of transformers' own greedy
`generate`; t5_m and t1_m, a 5-token and a 1-token forward over a cached prompt (what a verification costs).
With the drafter d, verifiers v and n drafted tokens per round, ideal per-token costs are
    single          t_d
    every_token     t_d + Σ t_v                  (every model steps once per token)
    safe, rounds    t_d + Σ t5_v / n             (one verification pass per round, no replacements)
    safe, overlap   max(t_d, Σ t1_v)             (verifiers score one token behind, on another core)
so the floor of safe / drafter_alone is t_d over that cost (n = the run's drafted tokens per round, for the
adaptive draft). Ensemble points cost extra drafter passes on top (replaced and discarded tokens).
A run with `--neighbour` keeps one core busy with a matrix-multiply loop, to show what overlap needs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .engine.ensemble import Ensemble
from .engine.gauge import ScheduleGauge
from .runtime.baseline import hf_generate
from .runtime.members import Member, load_member
from .runtime.placement import cpu_info, engine_thread, use_threads

PROMPT = (
    "Write a detailed, friendly explanation for a curious twelve-year-old of how a bicycle works: "
    "the frame, the wheels, the chain and gears, the brakes, and why riding it keeps you balanced.\n\n"
)
CONFIGS: dict[str, dict] = {
    "single": {"method": "single"},
    "every_token": {"method": "every_token"},
    "safe rounds": {"schedule": "rounds", "adaptive_draft": False},
    "safe + adaptive draft": {"schedule": "rounds", "adaptive_draft": True},
    "safe + overlap": {"schedule": "overlap", "adaptive_draft": False},
    "safe default": {},  # what a user gets: schedule="auto", adaptive_draft=True
}
BASELINE = "safe rounds"  # where greedy output is compared against


class PeakRSS:
    """Peak resident memory of this process while the block runs (sampled every 5 ms), in MiB."""

    def __enter__(self) -> PeakRSS:
        self.peak = self.start = _rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mib())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mib())


def print_json(result: Any, out: str | Path | None = None) -> None:
    """A benchmark's result: printed as JSON and, with `out`, written there too (folders made)."""
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n", encoding="utf-8")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def hf_per_token(member: Member, prompt: str, n: int, threads: int | None = None) -> dict:
    """transformers' greedy generate, forced to n tokens: seconds per token. With `threads`, it runs on a
    thread of its own with that many intra-op threads (torch's count elsewhere stays as it is)."""
    if threads is None:
        return _hf_generate(member, prompt, n)
    out: list[dict] = []
    process = torch.get_num_threads()

    def run() -> None:
        engine_thread()
        use_threads(threads, process)
        out.append(_hf_generate(member, prompt, n))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return {**out[0], "threads": threads}


def _hf_generate(member: Member, prompt: str, n: int) -> dict:
    prompt_ids = member.tokenizer(prompt)["input_ids"]
    with PeakRSS() as mem:
        wall = hf_generate(member, [prompt_ids], n, forced=True).wall_s
    return {
        "tokens": n,
        "wall_s": wall,
        "s_per_token": wall / n,
        "tokens_per_s": n / wall,
        "peak_rss_mib": mem.peak,
        "threads": torch.get_num_threads(),
    }


@torch.inference_mode()
def verify_forward(member: Member, prompt: str, k: int = 5, repeats: int = 5) -> float:
    """Median time of one k-token forward on top of a cached prompt (one verification pass)."""
    ids = member.prompt_ids(prompt)
    times = []
    for _ in range(repeats):
        cache = member.new_cache()
        member.forward(ids, cache)
        extra = ids[1 : 1 + k]
        start = time.perf_counter()
        member.forward(extra, cache, keep=k)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_run(ens: Ensemble, n: int, fresh_gauge: bool = False, **options: Any) -> dict:
    """One greedy request; `fresh_gauge`: schedule="auto" starts untimed, as in a fresh script (runs of
    other configurations before it would have timed both schedules already)."""
    if fresh_gauge:
        ens._schedule_gauge = ScheduleGauge()
    with PeakRSS() as mem:
        res = ens.generate(PROMPT, max_new_tokens=n, **options)
    s = res.stats
    drafter = ens.names[ens.drafter_index]
    return {
        "tokens": s.tokens,
        "wall_s": s.wall_time_s,
        "tokens_per_s": s.tokens_per_s,
        "s_per_token": s.wall_time_s / max(s.tokens, 1),
        "ensemble_rate": s.ensemble_rate,
        "replaced_tokens": s.replaced_tokens,
        "discarded_draft_tokens": s.discarded_draft_tokens,
        "rounds": s.rounds,
        "drafted_per_round": s.forward_passes.get(drafter, 0) / max(s.rounds, 1),
        "forward_passes": s.forward_passes,
        "finish_reason": res.finish_reason,
        "peak_rss_mib": mem.peak,
        "overlap_chunk": ens._schedule_gauge.chunk,
        "schedule_seconds_per_token": dict(ens._schedule_gauge.seconds_per_token),
        "text": res.text,
    }


def first_difference(a: str, b: str) -> int | None:
    """Index of the first character where two texts differ (None when equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def floor(config: dict, run: dict, t_d: float, t5: Sequence[float], t1: Sequence[float], n: int) -> float | None:
    """safe / drafter_alone if nothing but the schedule cost time (see the module docstring)."""
    if config.get("method") in ("single", "every_token"):
        return None
    if config.get("schedule") == "overlap" or (run["rounds"] > run["tokens"] and run["drafted_per_round"] <= 1.05):
        return t_d / max(t_d, sum(t1))
    drafted = run["drafted_per_round"] if config.get("adaptive_draft", True) else n
    return t_d / (t_d + sum(t5) / max(drafted, 1.0))


def _median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the upper one of an even count), with every run's figure beside it."""
    median = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    return {**median, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def bench_ensemble(
    specs: Sequence[str],
    lengths: Sequence[int],
    configs: dict[str, dict] = CONFIGS,
    draft_length: int = 5,
    hf_threads: Sequence[int] = (),
    repeats: int = 1,
    quantization: str | None = None,
) -> dict:
    """Every configuration at every length, `repeats` times in turns with HF `generate` of the drafter (a
    machine whose speed drifts, a hypervisor's neighbours, then moves both alike): medians and each run."""
    members = [load_member(s, quantization=quantization) for s in specs]
    started = time.perf_counter()
    ens = Ensemble(members)
    placement_s = time.perf_counter() - started
    ens.generate(PROMPT, max_new_tokens=2)  # warm-up (allocator, first-call paths)
    drafter, verifiers = members[0], members[1:]
    placement = ens.placement.describe() if ens.placement is not None else None
    out: dict = {
        "members": list(ens.names),
        "drafter": ens.names[0],
        "quantization": quantization,
        "placement": placement,
        "placement_s": placement_s,
        "lengths": {},
    }
    t5 = {m.name: verify_forward(m, PROMPT) for m in members}
    t1 = {m.name: verify_forward(m, PROMPT, k=1) for m in members}
    out["t5_s"], out["t1_s"] = t5, t1
    needs_all = any(c.get("method") == "every_token" for c in configs.values())  # its floor sums them
    for n in lengths:
        hf_runs: dict[str, list[dict]] = {m.name: [] for m in (members if needs_all else members[:1])}
        config_runs: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(repeats):
            for m in members if needs_all else members[:1]:
                hf_runs[m.name].append(hf_per_token(m, PROMPT, n))
            for name, options in configs.items():
                run = engine_run(ens, n, fresh_gauge=not options, draft_length=draft_length, **options)
                config_runs[name].append(run)
        hf = {name: _median_run(runs) for name, runs in hf_runs.items()}
        row: dict = {"hf_generate": hf, "configs": {name: _median_run(runs) for name, runs in config_runs.items()}}
        row["hf_generate_threads"] = {str(k): hf_per_token(drafter, PROMPT, n, threads=k) for k in hf_threads}
        for name, runs in config_runs.items():  # each run over the HF run just before it
            pairs = zip(runs, hf_runs[drafter.name])
            row["configs"][name]["vs_drafter_alone_runs"] = [r["tokens_per_s"] / h["tokens_per_s"] for r, h in pairs]
        t_d = hf[drafter.name]["s_per_token"]
        hf_tps = hf[drafter.name]["tokens_per_s"]
        t5_v, t1_v = [t5[v.name] for v in verifiers], [t1[v.name] for v in verifiers]
        every_cost = t_d + sum(hf[v.name]["s_per_token"] for v in verifiers) if needs_all else None
        base = row["configs"].get(BASELINE)
        best_tps = max([hf_tps] + [r["tokens_per_s"] for r in row["hf_generate_threads"].values()])
        for name, run in row["configs"].items():
            run["vs_drafter_alone"] = run["tokens_per_s"] / hf_tps
            run["vs_drafter_alone_best_threads"] = run["tokens_per_s"] / best_tps
            run["floor_vs_drafter_alone"] = floor(configs[name], run, t_d, t5_v, t1_v, draft_length)
            run["diverges_from_rounds_at_char"] = first_difference(base["text"], run["text"]) if base else None
        row["floor_every_token_vs_drafter_alone"] = t_d / every_cost if every_cost else None
        out["lengths"][str(n)] = row
        summary = {k: round(v["vs_drafter_alone"], 3) for k, v in row["configs"].items()}
        print(json.dumps({"n": n, "vs_drafter_alone": summary}), file=sys.stderr, flush=True)
    return out


def speed_table(results: Sequence[dict]) -> str:
    """Markdown: per member set and length, each configuration's tokens/s, its ratio to the drafter alone
    (floor), E/T, replacements, discarded draft tokens, passes per member and its divergence from rounds."""
    lines = [
        "| members | new tokens | configuration | tok/s | vs drafter alone (floor) | E/T | replaced | discarded "
        "| drafted/round | passes | diverges from rounds at char |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for result in results:
        neighbour = " (busy neighbour)" if result.get("neighbour") else ""
        for run in result["runs"]:
            members = " + ".join(run["members"]) + neighbour
            for n, row in run["lengths"].items():
                hf = row["hf_generate"][run["drafter"]]
                tps = hf["tokens_per_s"]
                lines.append(f"| {members} | {n} | drafter alone (HF generate) | {tps:.2f} | 1.00 |||||||")
                for k, other in row.get("hf_generate_threads", {}).items():
                    ratio = other["tokens_per_s"] / tps
                    lines.append(
                        f"| {members} | {n} | drafter alone (HF generate, {k} thread(s)) | {other['tokens_per_s']:.2f} "
                        f"| {ratio:.2f} |||||||"
                    )
                for name, r in row["configs"].items():
                    fl = r.get("floor_vs_drafter_alone")
                    ratio = f"{r['vs_drafter_alone']:.2f}" + (f" ({fl:.2f})" if fl else "")
                    passes = ", ".join(f"{k}={v}" for k, v in r["forward_passes"].items())
                    div = r.get("diverges_from_rounds_at_char")
                    lines.append(
                        f"| {members} | {n} | {name} | {r['tokens_per_s']:.2f} | {ratio} | {r['ensemble_rate']:.0%} "
                        f"| {r['replaced_tokens']} | {r['discarded_draft_tokens']} | {r['drafted_per_round']:.1f} "
                        f"| {passes} | {'–' if div is None else div} |"
                    )
    return "\n".join(lines) + "\n"


def ratio_table(results: Sequence[dict]) -> str:
    """Markdown: per CPU, member set and length, HF `generate`'s tokens/s and each configuration's ratio over
    it (median runs), with the replacements' floor of SAFE (kept tokens over drafter passes). docs/speed.md
    holds this table as generated from the committed JSON (a test regenerates it)."""
    lines = [
        "| CPU | members | weights | new tokens | HF `generate` tok/s | `single` | SAFE default | SAFE floor |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        cpu = result.get("cpu", {}).get("model_name", "?")
        for run in result["runs"]:
            members = " + ".join(run["members"])
            weights = run.get("quantization") or "float32"
            for n, row in run["lengths"].items():
                configs = row["configs"]
                cells = []
                for name in ("single", "safe default"):
                    cells.append(f"{configs[name]['vs_drafter_alone']:.2f}" if name in configs else "–")
                safe = configs.get("safe default")
                floor = "–"
                if safe is not None:
                    floor = f"{safe['tokens'] / max(safe['forward_passes'][run['drafter']], 1):.2f}"
                hf = row["hf_generate"][run["drafter"]]["tokens_per_s"]
                lines.append(f"| {cpu} | {members} | {weights} | {n} | {hf:.2f} | {' | '.join(cells)} | {floor} |")
    return "\n".join(lines) + "\n"


def plot_speed(results: Sequence[dict], path: str | Path) -> None:
    """Wall time against new tokens, one line per configuration, one panel per member set.

    Why: the scaling claim (SAFE vs every-token as outputs grow and members are added) is a curve. Runs
    of the same member set from several result files (e.g. a separate 2048-token run) are merged.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, ...], dict[str, dict[int, float]]] = {}
    for result in results:
        for run in result["runs"]:
            lines = panels.setdefault(tuple(run["members"]), {})
            for n, row in run["lengths"].items():
                entries = {f"hf_generate ({run['drafter']} alone)": row["hf_generate"][run["drafter"]]}
                for name, entry in {**entries, **row["configs"]}.items():
                    lines.setdefault(name, {})[int(n)] = entry["wall_s"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (members, lines) in zip(axes[0], panels.items()):
        for name, points in sorted(lines.items()):
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="new tokens", ylabel="wall time (s)")
        ax.set_title(" + ".join(members), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def busy_neighbour(enabled: bool) -> Iterator[None]:
    """A process multiplying matrices on one thread for as long as the block runs (a core taken)."""
    if not enabled:
        yield
        return
    code = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a = (a @ a).tanh()\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="safe-engine bench", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", dest="models", action="append", help="member spec (repeat; first = drafter)")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--configs", nargs="+", help=f"configuration names (default: all of {list(CONFIGS)})")
    p.add_argument("--neighbour", action="store_true", help="keep one core busy meanwhile (a matmul loop)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--hf-threads", type=int, nargs="+", default=[], help="also time HF generate with these thread counts"
    )
    p.add_argument("--repeats", type=int, default=1, help="run everything this many times in turns; medians")
    p.add_argument("--quantize", choices=["int8"], help="load the members quantized")
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    p.add_argument("--plot", help="write a PNG of wall time vs new tokens")
    p.add_argument("--markdown", help="write a Markdown table of the results")
    p.add_argument("--from-json", nargs="+", help="no new run: --plot / --markdown these result files instead")
    args = p.parse_args(argv)
    if args.from_json:
        if not (args.plot or args.markdown):
            p.error("--from-json needs --plot PATH and/or --markdown PATH")
        earlier = [json.loads(Path(f).read_text()) for f in args.from_json]
        if args.plot:
            plot_speed(earlier, args.plot)
        if args.markdown:
            Path(args.markdown).write_text(speed_table(earlier))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    sets = (
        [args.models]
        if args.models
        else [
            ["qwen2.5-coder-0.5b", "smollm2-135m"],
            ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"],
        ]
    )
    unknown = sorted(set(args.configs or ()) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    configs = {k: v for k, v in CONFIGS.items() if not args.configs or k in args.configs}
    with busy_neighbour(args.neighbour):
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "cpu": cpu_info(),
            "torch_threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "neighbour": args.neighbour,
            "prompt": PROMPT,
            "runs": [
                bench_ensemble(
                    specs,
                    args.lengths,
                    configs,
                    hf_threads=args.hf_threads,
                    repeats=args.repeats,
                    quantization=args.quantize,
                )
                for specs in sets
            ],
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot_speed([result], args.plot)
    if args.markdown:
        Path(args.markdown).write_text(speed_table([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
