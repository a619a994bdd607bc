"""Per-round overhead of members in Ray actors vs the same members in this process; bytes per round.

Runs one local Ray cluster and decodes the same prompts with three placements of the same models:
- local: every member in this process;
- ray:   every member in its own Ray actor (drafter included: one actor call per drafted token);
- mixed: the drafter here, the verifiers in Ray actors (one call per verifier per round).
Reports seconds per round (draft -> verify -> scan), the overhead per round vs local, actor calls and
pickled payload bytes per round, the bare call round trip, and whether every output equals the local one.

python benchmarks/ray_overhead.py                     # tiny random models over real tokenizers
python benchmarks/ray_overhead.py --real              # smollm2-135m + gemma3-270m demo models
python benchmarks/ray_overhead.py --out benchmarks/results/ray_overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from safe_engine import Ensemble, ModelSpec
from safe_engine.bench import print_json
from safe_engine.runtime.ray import RayMember

TINY = [("qwen2.5-7b-instruct", 1), ("llama2", 2), ("gpt2", 3)]
REAL = ["smollm2-135m", "gemma3-270m"]
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The capital of France is Paris. The capital of Germany is",
]


def tiny_specs(root: Path) -> list[ModelSpec]:
    """The unit tests' tiny 2-layer random Llamas over real tokenizers, saved as model directories."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import save_tiny_member

    return [ModelSpec(save_tiny_member(name, seed, root / f"{name}-{seed}")) for name, seed in TINY]


def measure(placements: dict[str, Ensemble], method: str, max_new_tokens: int, repeats: int) -> dict:
    """Per placement: median seconds per round, rounds, actor calls and bytes per round, the texts.

    Placements take turns prompt by prompt, so a load change on a shared machine hits all of them alike;
    traffic is the change of the Ray members' counters over each placement's own runs.
    """
    stats = {name: {"per_round": [], "rounds": 0, "texts": [], "traffic": Counter()} for name in placements}
    for ens in placements.values():
        ens.generate(PROMPTS[0], max_new_tokens=8, method=method)  # warm-up
    for _ in range(repeats):
        for prompt in PROMPTS:
            for name, ens in placements.items():
                remote = [m for m in ens.members if isinstance(m, RayMember)]
                before = _totals(remote)
                res = ens.generate(prompt, max_new_tokens=max_new_tokens, method=method)
                entry = stats[name]
                entry["traffic"].update(_totals(remote) - before)
                entry["per_round"].append(res.stats.wall_time_s / res.stats.rounds)
                entry["rounds"] += res.stats.rounds
                entry["texts"].append(res.text)
    want = stats["local"]["texts"]
    base = statistics.median(stats["local"]["per_round"])
    out = {}
    for name, entry in stats.items():
        rounds, traffic = entry["rounds"], entry["traffic"]
        ms = statistics.median(entry["per_round"]) * 1e3
        out[name] = {
            "equal_to_local": entry["texts"] == want,
            "ms_per_round": round(ms, 2),
            "overhead_ms_per_round": round(ms - base * 1e3, 2),
            "rounds_per_run": round(rounds / (repeats * len(PROMPTS)), 2),
            "actor_calls_per_round": round(traffic["calls"] / rounds, 2),
            "bytes_sent_per_round": round(traffic["bytes_sent"] / rounds),
            "bytes_received_per_round": round(traffic["bytes_received"] / rounds),
            "bytes_per_round": round((traffic["bytes_sent"] + traffic["bytes_received"]) / rounds),
            "actor_call_ms_per_round": round(traffic["call_us"] / rounds / 1e3, 2),
            "actor_compute_ms_per_round": round(traffic["compute_us"] / rounds / 1e3, 2),
            "transport_ms_per_round": round((traffic["call_us"] - traffic["compute_us"]) / rounds / 1e3, 2),
            "calls_per_round_by_method": {
                k.removeprefix("calls:"): round(v / rounds, 2) for k, v in traffic.items() if k.startswith("calls:")
            },
        }
    return out


def _totals(members: list[RayMember]) -> Counter:
    total: Counter = Counter()
    for m in members:
        snap = m.traffic.snapshot()
        total.update(
            {"calls": snap["calls"], "bytes_sent": snap["bytes_sent"], "bytes_received": snap["bytes_received"]}
        )
        # Counter drops non-positive entries on subtraction: keep times as integer microseconds
        total.update({"call_us": round(snap["call_s"] * 1e6), "compute_us": round(snap["compute_s"] * 1e6)})
        total.update({f"calls:{k}": v["calls"] for k, v in snap["by_method"].items()})
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true", help="use the demo models smollm2-135m + gemma3-270m")
    parser.add_argument("--methods", nargs="+", default=["safe", "every_token"])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per member (driver and actors)")
    parser.add_argument("--ray-address", default=None, help="an existing cluster ('auto'); default: a local one")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    import ray

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        specs = REAL if args.real else tiny_specs(Path(tmp))
        n = len(specs)
        if args.ray_address is None:
            ray.init(num_cpus=args.threads * n, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=args.ray_address, log_to_driver=False)
        resources = {"num_cpus": args.threads}
        t0 = time.perf_counter()
        local = Ensemble.from_pretrained(specs, backend="torch")  # Ray members run torch: like for like
        t1 = time.perf_counter()
        remote = Ensemble.from_pretrained(specs, backend="ray", member_resources=resources)
        t2 = time.perf_counter()
        placements = {
            "local": local,
            "ray": remote,
            "mixed": Ensemble([local.members[0], *remote.members[1:]]),
        }
        probe = remote.members[0]
        probe.ping()
        pings = []
        for _ in range(200):
            start = time.perf_counter()
            probe.ping()
            pings.append(time.perf_counter() - start)

        results: dict = {
            "models": [str(getattr(s, "path", s)) for s in specs],
            "models_kind": "demo" if args.real else "tiny random over real tokenizers",
            "max_new_tokens": args.max_new_tokens,
            "prompts": len(PROMPTS),
            "repeats": args.repeats,
            "torch_threads": args.threads,
            "load_s": {"local": round(t1 - t0, 2), "ray": round(t2 - t1, 2)},
            "actor_call_round_trip_ms": round(statistics.median(pings) * 1e3, 3),
            "methods": {},
        }
        for method in args.methods:
            results["methods"][method] = measure(placements, method, args.max_new_tokens, args.repeats)
        results["max_call_bytes"] = max(m.traffic.snapshot()["max_call_bytes"] for m in remote.members)
        ray.shutdown()
    print_json(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
