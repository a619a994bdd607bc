"""The server's life around the requests: auth off, loading, clients that leave, shutdown, the CLI."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from safe_engine import ConfigError, GenerationConfig
from safe_engine.server import BackgroundServer, create_app

from .conftest import KEY, MODEL, live_caches, wait_for

ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Tell me a long story."}]
LONG = 3000  # tokens: far more than a test waits for


def keep_streams(monkeypatch, ens) -> list:
    """Record the engine streams the server opens (to check afterwards that they were cancelled)."""
    opened = []
    original = ens.astream

    def stream(*args, **kwargs):
        s = original(*args, **kwargs)
        opened.append(s)
        return s

    monkeypatch.setattr(ens, "astream", stream)
    return opened


def test_no_key_is_needed_when_none_is_configured(served):
    app = create_app(served.ens, defaults=GenerationConfig(max_new_tokens=5))
    with BackgroundServer(app) as srv:
        res = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": USER}, timeout=60)
        assert res.status_code == 200
        assert res.json()["model"] == "+".join(served.ens.names)  # the default served name
        assert (
            res.json()["choices"][0]["message"]["content"] == served.ens.generate(messages=USER, max_new_tokens=5).text
        )


def test_503_while_loading_then_ready(served):
    release = threading.Event()

    def loader():
        release.wait(30)
        return served.ens

    app = create_app(loader, model_name=MODEL, defaults=GenerationConfig(max_new_tokens=4))
    with BackgroundServer(app) as srv:
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]:
            res = httpx.request(method, f"{srv.url}{path}", json={"messages": USER}, timeout=10)
            assert res.status_code == 503 and res.json()["error"]["code"] == "model_loading"
        release.set()
        wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=10).status_code == 200, what="the load")
        res = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": USER}, timeout=60)
        assert res.status_code == 200


def test_a_failed_load_is_a_503_that_says_why():
    def loader():
        raise OSError("no such model: /models/missing")

    with BackgroundServer(create_app(loader)) as srv:
        wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=10).json()["status"] == "failed", what="the failure")
        res = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": USER}, timeout=10)
        assert res.status_code == 503 and "/models/missing" in res.json()["error"]["message"]


def test_a_client_leaving_a_stream_cancels_its_generation(served, monkeypatch):
    opened = keep_streams(monkeypatch, served.ens)
    body = {"model": MODEL, "messages": USER, "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", f"{served.v1}/chat/completions", json=body, headers=AUTH, timeout=60) as res:
        assert res.status_code == 200
        got = 0
        for line in res.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 4:
                    break
    # the connection is closed: the generation must stop long before its 3000 tokens
    served.wait_idle(timeout=20)
    (stream,) = opened
    assert stream.result is None  # cancelled, never finished
    assert served.ens.open_requests == 0 and live_caches() == 0


def test_a_client_leaving_a_stream_of_several_choices_cancels_them_all(served, monkeypatch):
    opened = keep_streams(monkeypatch, served.ens)
    body = {"model": MODEL, "prompt": ["Once", "Twice"], "n": 2, "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", f"{served.v1}/completions", json=body, headers=AUTH, timeout=60) as res:
        assert res.status_code == 200
        for got, _ in enumerate(line for line in res.iter_lines() if line.startswith("data: ")):
            if got == 6:
                break
    served.wait_idle(timeout=20)
    assert len(opened) == 4 and all(stream.result is None for stream in opened)
    assert served.ens.open_requests == 0 and live_caches() == 0
    assert served.server.server.config.app.state.safe.admitted == 0  # every place in the queue given back


def test_a_client_leaving_a_plain_request_cancels_it(served, monkeypatch):
    opened = keep_streams(monkeypatch, served.ens)
    body = {"model": MODEL, "messages": USER, "max_tokens": LONG}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{served.v1}/chat/completions", json=body, headers=AUTH, timeout=1.0)
    served.wait_idle(timeout=20)
    (stream,) = opened
    assert stream.result is None
    assert served.ens.open_requests == 0 and live_caches() == 0


def test_shutdown_ends_running_streams_cleanly(served):
    app = create_app(served.ens, model_name=MODEL)
    srv = BackgroundServer(app, shutdown_grace_s=0.5).start()
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=LONG, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    from openai import APIError

    with pytest.raises(APIError, match="shutting down"):  # the SDK raises the stream's error event
        for _ in stream:
            pass
    stopper.join(30)
    assert not stopper.is_alive()
    # the shutdown waited for the cancelled round to end: no decoding thread outlives the server
    assert served.ens.open_requests == 0
    assert not any(t.name == "safe-scheduler" for t in threading.enumerate())


# -- the command line ------------------------------------------------------------------------------------------
def start_cli(model_dirs: list[str], *extra: str) -> tuple[subprocess.Popen, str]:
    """`python -m safe_engine serve ...` on a free port; returns the process and its base URL."""
    args = [sys.executable, "-m", "safe_engine", "serve", "--port", "0", "--max-new-tokens", "6"]
    for d in model_dirs:
        args += ["-m", d]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        args + list(extra), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("Serving "):
            url = line.split(" at ", 1)[1].split()[0]
            return proc, url.removesuffix("/v1")
    proc.kill()
    raise AssertionError(f"the server did not print its URL: {proc.stderr.read()[-2000:]}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_serves_then_shuts_down_gracefully_on_a_signal(model_dirs, sig):
    proc, url = start_cli(
        model_dirs,
        *("--api-key", KEY, "--served-model-name", MODEL, "--shutdown-timeout", "1"),
        *("--max-batch-size", "3", "--max-queue", "0"),
    )
    try:
        assert url.startswith("http://127.0.0.1:")
        res = httpx.post(
            f"{url}/v1/chat/completions", json={"model": MODEL, "messages": USER}, headers=AUTH, timeout=60
        )
        assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] <= 6
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}, timeout=10).status_code == 401
        # --max-queue 0 with a batch of 3: four choices can never be held at once
        too_many = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "n": 4}, headers=AUTH, timeout=10)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        assert "safe_requests_total" in httpx.get(f"{url}/metrics", timeout=10).text
        # a batch decoding: three streams (the batch's three places), the signal once each has its first chunks
        body = {"model": MODEL, "messages": USER, "max_tokens": LONG, "stream": True}
        streams: list[list[str]] = [[] for _ in range(3)]
        going = threading.Barrier(len(streams) + 1)

        def read(events: list[str]) -> None:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            going.wait(30)

        readers = [threading.Thread(target=read, args=(events,)) for events in streams]
        for reader in readers:
            reader.start()
        going.wait(60)
        proc.send_signal(sig)
        for reader in readers:
            reader.join(60)
        for events in streams:
            assert events[-1] == "[DONE]"  # each stream ended cleanly, not cut off
            last = json.loads(events[-2])  # its last chunk says why, in OpenAI's error shape
            assert last["error"]["code"] == "server_shutdown" and "shutting down" in last["error"]["message"]
        assert proc.wait(timeout=30) == 0
        stderr = proc.stderr.read()
        assert "[server stopped: 0 open requests, no decoding thread left]" in stderr
        # the startup line says where the forwards run (OMP_NUM_THREADS=1 here: the user's count is kept)
        assert "threads: user: 1 thread(s) for every forward" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_engine_and_the_cli_work_without_fastapi():
    code = (
        "import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None\n"
        "import safe_engine, safe_engine.server\n"
        "from safe_engine.cli import build_parser, main\n"
        "args = build_parser().parse_args(['serve', '-m', 'a', '-m', 'b', '--port', '0'])\n"
        "assert args.port == 0 and args.host == '127.0.0.1' and args.max_batch_size == 8\n"
        "sys.exit(main(['serve', '-m', 'a', '-m', 'b']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "pip install 'langchain-safe[server]'" in res.stderr


def stalling_client(app, after: int = 2):
    """The app, with the `send` of requests marked `x-stall: 1` blocking for good after `after` body chunks:
    what uvicorn's `send` does once a client that stopped reading has let the socket's buffers fill (on
    loopback that takes megabytes of output, so the test blocks it directly)."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or (b"x-stall", b"1") not in scope["headers"]:
            return await app(scope, receive, send)
        chunks = 0

        async def stalling(message):
            nonlocal chunks
            if message["type"] == "http.response.body":
                chunks += 1
                if chunks > after:
                    await asyncio.Event().wait()  # the client reads nothing more
            await send(message)

        return await app(scope, receive, stalling)

    wrapped.state = app.state
    return wrapped


def test_a_stream_whose_client_stops_reading_ends_at_the_idle_deadline(served, monkeypatch):
    """A client that keeps its connection open but reads nothing: once the server's next chunk has waited
    `stream_idle_timeout` seconds, the request is cancelled (caches freed) and the connection closed; a
    stream beside it runs meanwhile, not waiting for that deadline."""
    opened = keep_streams(monkeypatch, served.ens)
    deadline_s = 3.0
    app = create_app(served.ens, model_name=MODEL, stream_idle_timeout=deadline_s)
    body = {"model": MODEL, "messages": USER, "max_tokens": LONG, "stream": True}
    other = {"model": MODEL, "messages": USER, "max_tokens": 12, "stream": True}
    with BackgroundServer(stalling_client(app)) as srv:
        t0 = time.monotonic()
        with httpx.stream(
            "POST", f"{srv.url}/v1/chat/completions", json=body, headers={"x-stall": "1"}, timeout=60
        ) as stalled:
            assert stalled.status_code == 200
            lines = stalled.iter_lines()
            assert next(lines).startswith("data: ")  # the first chunk; then the client's buffers are "full"
            wait_for(lambda: served.ens.open_requests == 1, what="the stalled request to decode")
            started = time.monotonic()
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=other, timeout=60) as res:
                beside = [line for line in res.iter_lines() if line.startswith("data: ")]
            beside_s = time.monotonic() - started
            assert served.ens.open_requests == 1  # the stalled one still decodes: its deadline is not up
            wait_for(lambda: served.ens.open_requests == 0, timeout=30, what="the idle deadline")
            ended_s = time.monotonic() - t0
            rest = []
            with pytest.raises(httpx.RemoteProtocolError):  # the server closed the connection mid-response
                rest.extend(lines)
            assert "data: [DONE]" not in rest
    assert beside[-1] == "data: [DONE]" and json.loads(beside[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert opened[0].result is None  # cancelled at the deadline, not decoded to its 3000 tokens
    assert served.ens.open_requests == 0 and live_caches() == 0
    assert beside_s < deadline_s <= ended_s, (beside_s, ended_s)


def test_the_stream_idle_timeout_is_checked():
    with pytest.raises(ConfigError, match="stream_idle_timeout"):
        create_app(lambda: None, stream_idle_timeout=0)
    res = subprocess.run(
        [sys.executable, "-m", "safe_engine", "serve", "-m", "a", "-m", "b", "--stream-idle-timeout", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "--stream-idle-timeout must be >= 0" in res.stderr


def test_a_client_leaving_while_sending_its_body_is_not_a_server_error(served):
    """A client cancelled mid-upload: no 'Exception in ASGI application' in the server's log, nothing held."""
    errors: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(record.getMessage())

    handler = Record(level=logging.ERROR)
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as client:
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            client.sendall(f"{head}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode())
            client.sendall(b'{"messages": [{"role": "user", "content": "a body that never ends')
            time.sleep(0.3)
        wait_for(lambda: served.health()["status"] == "ok", what="the server")
        time.sleep(0.5)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert errors == []
    assert served.wait_idle()["open_requests"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_finished_request_is_freed_without_the_garbage_collector(served, monkeypatch, stream):
    """The soak's growth: a reference cycle (a StopAsyncIteration re-raised in the stream loop, whose traceback
    took in the frame that held it) kept each finished request, its stream and connection until the GC's rare
    full pass. With the cyclic GC off, reference counting alone must free every finished request."""
    scheduler = served.ens._scheduler
    submitted: list[weakref.ref] = []
    original = scheduler.submit
    monkeypatch.setattr(scheduler, "submit", lambda g, *a: submitted.append(weakref.ref(g)) or original(g, *a))
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "n": 2, "stream": stream}
    gc.collect()
    gc.disable()
    try:
        res = httpx.post(f"{served.v1}/chat/completions", json=body, headers=AUTH, timeout=60)
        assert res.status_code == 200 and ("[DONE]" in res.text if stream else len(res.json()["choices"]) == 2)
        served.wait_idle()
        assert len(submitted) == 2
        wait_for(lambda: all(ref() is None for ref in submitted), timeout=10, what="the requests to be freed")
    finally:
        gc.enable()
