"""Speed benchmark: every configuration side by side in one run, with the ratios' floors.

Per member m, measured here in the same process: t_m, the per-token time of transformers' own greedy
`generate`, and t5_m, one 5-token forward over a cached prompt (what one verification costs). With the
drafter d, verifiers v and draft length n, ideal per-token costs are
    single      t_d
    every_token t_d + Σ t_v           (every model steps once per token)
    safe        t_d + Σ t5_v / n      (one verification pass per n drafted tokens, no rollbacks)
so the floors of the throughput ratios are t_d / (t_d + Σ t5_v / n) for safe / drafter_alone and
(t_d + Σ t_v) / (t_d + Σ t5_v / n) for safe / every_token. Ensemble points cost extra rounds on top.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .ensemble import Ensemble
from .members import Member, load_member

PROMPT = (
    "Write a detailed, friendly explanation for a curious twelve-year-old of how a bicycle works: "
    "the frame, the wheels, the chain and gears, the brakes, and why riding it keeps you balanced.\n\n"
)
CONFIGS = (("single", "unite"), ("every_token", "unite"), ("every_token", "gac"), ("safe", "unite"), ("safe", "gac"))


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


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@torch.inference_mode()
def hf_per_token(member: Member, prompt: str, n: int) -> dict:
    """transformers' greedy generate, forced to n tokens: seconds per token."""
    enc = member.tokenizer(prompt, return_tensors="pt").to(member.device)
    start = time.perf_counter()
    with PeakRSS() as mem:
        member.model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    wall = time.perf_counter() - start
    return {"tokens": n, "wall_s": wall, "s_per_token": wall / n, "tokens_per_s": n / wall, "peak_rss_mib": mem.peak}


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


def engine_run(ens: Ensemble, method: str, aggregation: str, n: int) -> dict:
    with PeakRSS() as mem:
        res = ens.generate(PROMPT, max_new_tokens=n, method=method, aggregation=aggregation)
    s = res.stats
    return {
        "tokens": s.tokens,
        "wall_s": s.wall_time_s,
        "tokens_per_s": s.tokens_per_s,
        "s_per_token": s.wall_time_s / max(s.tokens, 1),
        "ensemble_rate": s.ensemble_rate,
        "rounds": s.rounds,
        "forward_passes": s.forward_passes,
        "finish_reason": res.finish_reason,
        "peak_rss_mib": mem.peak,
    }


def bench_ensemble(specs: Sequence[str], lengths: Sequence[int], configs=CONFIGS, draft_length: int = 5) -> dict:
    members = [load_member(s) for s in specs]
    ens = Ensemble(members)
    ens.generate(PROMPT, max_new_tokens=2)  # warm-up (allocator, first-call paths)
    drafter, verifiers = members[0], members[1:]
    out: dict = {"members": list(ens.names), "drafter": ens.names[0], "lengths": {}}
    t5 = {m.name: verify_forward(m, PROMPT) for m in members}
    out["t5_s"] = t5
    for n in lengths:
        row: dict = {"hf_generate": {m.name: hf_per_token(m, PROMPT, n) for m in members}}
        for method, aggregation in configs:
            row[f"{method}:{aggregation}"] = engine_run(ens, method, aggregation, n)
        t = {name: r["s_per_token"] for name, r in row["hf_generate"].items()}
        t_d = t[drafter.name]
        safe_cost = t_d + sum(t5[v.name] for v in verifiers) / draft_length
        floors = {
            "safe/drafter_alone": t_d / safe_cost,
            "safe/every_token": (t_d + sum(t[v.name] for v in verifiers)) / safe_cost,
            "single/hf_generate": 1.0,
        }
        hf_tps = row["hf_generate"][drafter.name]["tokens_per_s"]
        ratios = {
            "safe/drafter_alone": row["safe:unite"]["tokens_per_s"] / hf_tps if "safe:unite" in row else None,
            "safe/every_token": (row["safe:unite"]["tokens_per_s"] / row["every_token:unite"]["tokens_per_s"])
            if "safe:unite" in row and "every_token:unite" in row
            else None,
            "single/hf_generate": row["single:unite"]["tokens_per_s"] / hf_tps if "single:unite" in row else None,
        }
        row["ratios"] = {k: {"measured": ratios[k], "floor": floors[k]} for k in floors}
        out["lengths"][str(n)] = row
        print(json.dumps({"n": n, "ratios": row["ratios"]}), file=sys.stderr, flush=True)
    return out


def speed_table(results: Sequence[dict]) -> str:
    """Markdown: tokens/s and E/T per configuration, and each ratio next to its floor, per set and length."""
    lines = [
        "| members | new tokens | drafter alone (HF) tok/s | single | every_token UniTE / GaC | SAFE UniTE / GaC "
        "| SAFE E/T UniTE / GaC | safe/drafter_alone (floor) | safe/every_token (floor) | single/hf_generate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for run in result["runs"]:
            for n, row in run["lengths"].items():
                cells = [" + ".join(run["members"]), n, f"{row['hf_generate'][run['drafter']]['tokens_per_s']:.2f}"]
                for keys, field, fmt in (
                    (["single:unite"], "tokens_per_s", ".2f"),
                    (["every_token:unite", "every_token:gac"], "tokens_per_s", ".2f"),
                    (["safe:unite", "safe:gac"], "tokens_per_s", ".2f"),
                    (["safe:unite", "safe:gac"], "ensemble_rate", ".0%"),
                ):
                    cells.append(" / ".join(format(row[k][field], fmt) if k in row else "–" for k in keys))
                for name, ratio in row["ratios"].items():
                    measured = "–" if ratio["measured"] is None else f"{ratio['measured']:.2f}"
                    floor = "" if name == "single/hf_generate" else f" ({ratio['floor']:.2f})"
                    cells.append(measured + floor)
                lines.append("| " + " | ".join(cells) + " |")
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
                for name, entry in row.items():
                    if name == "ratios":
                        continue
                    if name == "hf_generate":
                        name, entry = f"hf_generate ({run['drafter']} alone)", entry[run["drafter"]]
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="safe-engine bench", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", dest="models", action="append", help="member spec (repeat; first = drafter)")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--configs", nargs="+", help="METHOD:AGGREGATION list (default: all five)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
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
    configs = [tuple(c.split(":", 1)) for c in args.configs] if args.configs else CONFIGS
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch_threads": torch.get_num_threads(),
        "prompt": PROMPT,
        "runs": [bench_ensemble(specs, args.lengths, configs) for specs in sets],
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
