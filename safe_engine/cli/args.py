"""What the commands share: the member flags, the generation flags (one per GenerationConfig field, and
the request's shape: --json-schema, --json-object, --tools, --tool-choice), loading, the stats line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..engine.ensemble import Ensemble
from ..errors import ConfigError
from ..knobs import add_cli_arguments, cli_options
from ..runtime.quantization import QUANTIZATIONS
from ..stats import GenerationResult


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        dest="models",
        action="append",
        required=True,
        metavar="SPEC",
        help="hub id, directory, .gguf file or demo name; repeat for each member (first = drafter)",
    )
    p.add_argument("--drafter", type=int, default=0, help="index of the drafter among -m (default 0)")
    p.add_argument("--weights", type=float, nargs="+", help="one weight per member")
    p.add_argument("--device", help="device for all members (cpu, cuda:0, auto)")
    p.add_argument("--dtype", help="float32, bfloat16, float16")
    p.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        help="int8: members with int8 linear layers (CPU; bitsandbytes 8-bit on a GPU); docs/quantization.md",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "torch", "llama.cpp"),
        default="auto",
        help="where members run: auto (a GGUF source on the CPU in llama.cpp when installed, else torch), torch, "
        "llama.cpp; docs/llamacpp.md",
    )
    p.add_argument(
        "--kv-positions",
        type=int,
        metavar="N",
        help="KV positions each llama.cpp member's requests share (default one window, 4096); docs/llamacpp.md",
    )


def add_generation_args(p: argparse.ArgumentParser) -> None:
    add_cli_arguments(p)  # one flag per GenerationConfig field


def add_request_args(p: argparse.ArgumentParser) -> None:
    """The reply's shape, as `build_request` takes it (with --chat)."""
    p.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="constrain the reply to this JSON schema (a file or JSON), strictly: an object takes only the keys "
        "it names unless it says additionalProperties",
    )
    p.add_argument("--json-object", action="store_true", help="JSON mode: the reply is one JSON object")
    p.add_argument("--tools", metavar="FILE", help="a JSON file with a list of OpenAI-style tool schemas")
    p.add_argument("--tool-choice", help="auto | none | required | a tool name (with --tools)")
    p.add_argument(
        "--no-parallel-tool-calls", action="store_true", help="one tool call at most (OpenAI's parallel_tool_calls)"
    )


def request_options(args: argparse.Namespace) -> dict[str, Any]:
    """`build_request` keywords from `add_request_args`' flags."""
    out: dict[str, Any] = {}
    if args.json_schema:
        out["json_schema"] = _json_argument(args.json_schema, "--json-schema")
    if args.json_object:
        out["response_format"] = {"type": "json_object"}
    if args.tools:
        out["tools"] = _json_argument(args.tools, "--tools")
    if args.tool_choice:
        out["tool_choice"] = args.tool_choice
    if args.no_parallel_tool_calls:
        out["parallel_tool_calls"] = False
    return out


def _json_argument(value: str, flag: str) -> Any:
    """JSON given inline or as a file path."""
    text = Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{flag}: not a JSON file or JSON text ({err})", option=flag) from None


def options(args: argparse.Namespace) -> dict[str, Any]:
    return cli_options(args)


def load(args: argparse.Namespace, max_batch_size: int = 8, announce: bool = True) -> Ensemble:
    """The ensemble of the -m flags; `announce` prints a "loaded" line on stderr."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "loaded" line instead of a bar per weight file
    started = time.perf_counter()
    ens = Ensemble.from_pretrained(
        args.models,
        drafter=args.drafter,
        weights=args.weights,
        device_map=args.device,
        dtype=args.dtype,
        quantization=args.quantize,
        backend=args.backend,
        kv_positions=args.kv_positions,
        max_batch_size=max_batch_size,
    )
    if announce:
        print(loaded_line(ens, time.perf_counter() - started), file=sys.stderr)
    return ens


def loaded_line(ens: Ensemble, seconds: float) -> str:
    """What was loaded, in how long, and where its forwards run (the placement measured at load)."""
    placement = f"; threads: {ens.placement.describe()}" if ens.placement is not None else ""
    members = ", ".join(f"{name} ({m.backend})" for name, m in zip(ens.names, ens.members))
    return f"[loaded {members} in {seconds:.1f} s; drafter {ens.names[ens.drafter_index]}{placement}]"


def stats_line(result: GenerationResult, ens: Ensemble | None = None) -> str:
    placement = "" if ens is None or ens.placement is None else f"; threads: {ens.placement.describe(measured=False)}"
    return f"[{result.stats.summary()}; finish={result.finish_reason}{placement}]"
