"""`safe-engine`: generate, chat, models, bench, eval and serve from the command line.

User mistakes (bad spec, unknown method, missing chat template) print one line on stderr and exit 2;
no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, SafeEngineError
from ..runtime import demo_models
from ..shaping.request import build_request
from ..stats import GenerationResult
from .args import add_generation_args, add_model_args, add_request_args, load, options, request_options, stats_line
from .serve import add_parser as add_serve_parser


def cmd_generate(args: argparse.Namespace) -> int:
    inputs: dict = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    if args.system and args.chat:
        inputs["messages"].insert(0, {"role": "system", "content": args.system})
    knobs = options(args)  # the generation flags given (a flag not given is no attribute of args)
    if knobs.get("logprobs") is not None and not args.json:
        raise ConfigError("--logprobs is reported in the JSON output only; add --json")
    request = build_request(**inputs, **request_options(args), **knobs)  # checked before the (slow) load
    ens = load(args)
    if args.stream and not args.json:
        stream = ens.stream(request)
        for event in stream.events():
            print(event.content, end="", flush=True)
        print()
        result = stream.result
        assert result is not None
    else:
        result = ens.generate(request)
        if not args.json:
            print(result.content)
    if args.json:
        reply: dict[str, Any] = {"text": result.text, "content": result.content, "finish_reason": result.finish_reason}
        if result.tool_calls is not None:
            reply.update(tool_calls=result.tool_calls, invalid_tool_calls=result.invalid_tool_calls)
        if result.logprobs is not None:  # OpenAI's chat shape, each token with its source
            reply["logprobs"] = {"content": [e.to_dict() for e in result.logprobs]}
        print(json.dumps({**reply, "stats": result.stats.to_dict()}, ensure_ascii=False))
    else:
        print(stats_line(result, ens), file=sys.stderr)
    if knobs.get("trace"):
        _write_trace(result, args.trace)
    return 0


def _write_trace(result: GenerationResult, path: str) -> None:
    lines = "".join(json.dumps(p.to_dict(), ensure_ascii=False) + "\n" for p in result.trace or ())
    if path == "-":
        sys.stdout.write(lines)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(lines)


def cmd_chat(args: argparse.Namespace) -> int:
    knobs = options(args)
    if knobs.get("logprobs") is not None:
        raise ConfigError("the interactive chat prints text only; for --logprobs use `generate --json`")
    build_request(" ", **knobs)  # checked before the (slow) load
    ens = load(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the ensemble; empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line or line in {"/exit", "/quit"}:
            break
        history.append({"role": "user", "content": line})
        print("ensemble> ", end="", flush=True)
        stream = ens.stream(messages=history, **knobs)
        for delta in stream:
            print(delta, end="", flush=True)
        print()
        assert stream.result is not None
        print(stats_line(stream.result, ens), file=sys.stderr)
        history.append({"role": "assistant", "content": stream.result.text})
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        default = [name for name, spec in demo_models.DEMO_MODELS.items() if spec.fetch_by_default]
        for name in args.names or default:
            started = time.perf_counter()
            if args.gguf:  # fetch re-hashes a cached GGUF; an altered one is fetched again
                path = demo_models.fetch(name)
                demo_models.tokenizer_dir(path, demo_models.DEMO_MODELS[name].sha256)
            else:
                path = demo_models.model_dir(name, verify=True)  # an altered cached file is rebuilt
            print(f"{name}: {path} ({time.perf_counter() - started:.1f} s)")
        return 0
    for row in demo_models.list_models():
        state = "converted" if row["converted"] else "fetched" if row["fetched"] else "not fetched"
        print(f"{row['name']:<20} {state:<12} {row['description']}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..eval import load_task, make_ensemble_config, run_eval, write_report

    problems = load_task(args.task, data_dir=args.data, limit=args.limit, seed=args.seed)
    ens = load(args)
    configs = {}
    for method in args.methods:
        name, _, aggregation = method.partition(":")
        configs[method] = make_ensemble_config(
            ens,
            method=name,
            aggregation=aggregation or "unite",
            max_new_tokens=args.max_new_tokens,
            chat=not args.fewshot,
            seed=args.seed,
        )
    out = Path(args.out)
    run_eval(configs, problems, out / f"{args.task.replace(':', '_')}.jsonl")
    paths = write_report(out / f"{args.task.replace(':', '_')}.jsonl", out, title=f"{args.task} ({len(problems)})")
    print(json.dumps({k: str(v) for k, v in paths.items()} if isinstance(paths, dict) else str(paths)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench import main as bench_main

    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safe-engine", description="SAFE ensembling of causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate one completion or chat reply")
    add_model_args(gen)
    add_generation_args(gen)
    gen.add_argument("--stream", action="store_true", help="print verified text as it is produced")
    gen.add_argument("--chat", action="store_true", help="treat PROMPT as a user message (chat templates)")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument("--json", action="store_true", help="print a JSON result instead of text")
    add_request_args(gen)
    gen.add_argument("prompt", metavar="PROMPT")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive streaming chat")
    add_model_args(chat)
    add_generation_args(chat)
    chat.add_argument("--system", help="system message")
    chat.set_defaults(func=cmd_chat)

    models = sub.add_parser("models", help="the offline demo models")
    actions = models.add_subparsers(dest="action", required=True)
    fetch = actions.add_parser("fetch", help="fetch, verify and convert demo models")
    fetch.add_argument(
        "names", nargs="*", metavar="NAME", help="demo models to fetch (default: all but the large qwen2.5-coder-1.5b)"
    )
    fetch.add_argument(
        "--gguf",
        action="store_true",
        help="fetch and verify the GGUF and save its tokenizer only (what a llama.cpp member runs), with no float32 "
        "conversion",
    )
    actions.add_parser("list", help="the demo models and what is cached")
    models.set_defaults(func=cmd_models)

    ev = sub.add_parser("eval", help="benchmark accuracy of several configurations")
    add_model_args(ev)
    ev.add_argument("--task", required=True, help="gsm8k, math500, bbh[:task], arc, mmlu-redux[:subject]")
    ev.add_argument("--limit", type=int)
    ev.add_argument("--seed", type=int)
    ev.add_argument("--data", help="benchmark data folder (default: ../shared/data)")
    ev.add_argument(
        "--method",
        dest="methods",
        action="append",
        help="configuration as METHOD[:AGGREGATION], repeatable (default: single, safe:unite)",
    )
    ev.add_argument("--max-new-tokens", type=int, default=384)
    ev.add_argument("--fewshot", action="store_true", help="few-shot plain prompts (base models)")
    ev.add_argument("--out", default="benchmarks/results", help="output folder")
    ev.set_defaults(func=cmd_eval)

    bench = sub.add_parser("bench", help="speed benchmark (see benchmarks/speed.py --help)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    add_serve_parser(sub)  # no FastAPI import until `serve` runs
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    bench = argv[:1] == ["bench"]  # it has its own parser (argparse's REMAINDER drops leading options)
    args = parser.parse_args(argv[:1] if bench else argv)
    if bench:
        args.rest = argv[1:]
    if getattr(args, "methods", ()) is None:
        args.methods = ["single", "safe:unite"]
    try:
        return args.func(args)
    except SafeEngineError as err:
        print(f"safe-engine: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
