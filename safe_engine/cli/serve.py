"""`safe-engine serve`: load the members, serve them as one OpenAI-compatible model.

Nothing here imports FastAPI or uvicorn until the command runs, so `safe-engine` works without the
`[server]` extra.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from ..errors import ConfigError, SafeEngineError
from ..shaping.request import build_request
from .args import add_generation_args, add_model_args, load, loaded_line, options


def add_parser(sub: Any) -> None:
    """Register `serve` on the CLI's subparsers."""
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, "
        "/health, /metrics",
        description="Serve the ensemble as one OpenAI-compatible model. Generation flags set the defaults "
        "a request does not override.",
    )
    add_model_args(p)
    add_generation_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SAFE_ENGINE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $SAFE_ENGINE_API_KEY; none: open)",
    )
    p.add_argument("--served-model-name", help="the model name clients use (default: the member names joined by +)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests decoded at once (default 8)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests that may wait for a slot in the batch; beyond it a 503 with Retry-After (default: unbounded)",
    )
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (default 4 MiB)")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running streams may finish after SIGINT/SIGTERM before they are ended (default 30)",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=60.0,
        help="seconds a stream's next chunk may wait for a client that stopped reading (without leaving) "
        "before the stream is ended, its generation cancelled and the connection closed (default 60; 0: never)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (info shows every request)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if "trace" in options(args):
        raise ConfigError('--trace is per request when serving: send "trace": true in the request body')
    if args.stream_idle_timeout < 0:
        raise ConfigError(f"--stream-idle-timeout must be >= 0 seconds (0: never), got {args.stream_idle_timeout}")
    if args.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.max_queue is not None and args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    # the defaults a request does not override, by the shared semantics; checked before the (slow) load
    defaults = build_request(" ", **{**options(args), "trace": False}).config
    try:
        from ..server.app import create_app
        from ..server.runner import make_server
    except ImportError as err:
        raise SafeEngineError(
            f"serving needs FastAPI and uvicorn ({err}); install them with: pip install 'langchain-safe[server]'"
        ) from None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        warning = f"[warning: serving on {args.host} without --api-key: anyone who can reach it can use it]"
        print(warning, file=sys.stderr)

    started = time.perf_counter()
    server = None
    url = ""

    def ready(state: Any) -> None:
        ens = state.ensemble
        print(loaded_line(ens, time.perf_counter() - started), file=sys.stderr)
        print(f"Serving {state.name!r} at {url}/v1 (Ctrl-C to stop)", flush=True)

    def failed(err: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(
        lambda: load(args, max_batch_size=args.max_batch_size, announce=False),
        model_name=args.served_model_name,
        api_key=args.api_key,
        defaults=defaults,
        max_body_bytes=args.max_body_bytes,
        max_queue=args.max_queue,
        stream_idle_timeout=args.stream_idle_timeout or None,
        on_ready=ready,
        on_load_error=failed,
    )
    server, sock, url = make_server(app, args.host, args.port, args.shutdown_timeout, args.log_level)
    print(f"[loading {', '.join(args.models)}; {url}/health answers 503 until then]", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down; a no-op handler makes that a
    # clean exit (status 0) instead of a KeyboardInterrupt or a kill.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    state = app.state.safe
    if state.load_error is not None:
        load_error = state.load_error
        if isinstance(load_error, SafeEngineError):
            raise load_error
        raise SafeEngineError(f"loading failed: {load_error}")
    ens = state.ensemble
    idle = ens is None or ens.wait_idle(0)  # the lifespan's end already waited for the last round
    open_requests = 0 if ens is None else ens.open_requests
    decoding = "no decoding thread left" if idle else "decoding still running"
    print(f"[server stopped: {open_requests} open requests, {decoding}]", file=sys.stderr)
    return 0


def _ignore(sig: int, frame: Any) -> None:
    pass
