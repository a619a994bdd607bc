"""Running the app on uvicorn: in the foreground (`safe-engine serve`) or in a thread (tests, notebooks).

Graceful shutdown: the first SIGINT/SIGTERM stops accepting connections and refuses new requests with
503; streams already running may finish for `shutdown_grace_s` seconds, then each ends with an error
event and `data: [DONE]` (its generation cancelled, its caches freed). A second SIGINT quits at once.
"""

from __future__ import annotations

import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from .state import ServerState


class SafeServer(uvicorn.Server):
    """uvicorn.Server that gives the app's running streams a deadline when asked to stop."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_grace_s = shutdown_grace_s

    def begin_shutdown(self) -> None:
        if self.state.shutdown_deadline is None:
            self.state.shutdown_deadline = time.monotonic() + self.shutdown_grace_s
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.shutdown_deadline is None:
            self.state.shutdown_deadline = time.monotonic() + self.shutdown_grace_s
        super().handle_exit(sig, frame)


def make_server(
    app: Any, host: str = "127.0.0.1", port: int = 8000, shutdown_grace_s: float = 30.0, log_level: str = "warning"
) -> tuple[SafeServer, Any, str]:
    """(server, its bound socket, base URL): the socket is bound here, so port 0 picks a free port."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=int(shutdown_grace_s) + 5,  # a backstop: streams end at the grace deadline
    )
    server = SafeServer(config, app.state.safe, shutdown_grace_s)
    sock = config.bind_socket()
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return server, sock, f"http://{shown}:{bound_port}"


class BackgroundServer:
    """Serve an app from a daemon thread: `with BackgroundServer(app) as srv: OpenAI(base_url=srv.url + "/v1")`.

    Binds 127.0.0.1 on a free port by default; `stop()` (or leaving the `with`) shuts it down gracefully.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, shutdown_grace_s: float = 5.0) -> None:
        self.server, self._socket, self.url = make_server(app, host, port, shutdown_grace_s)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="safe-serve-http", daemon=True
        )

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread ended during startup; see its log above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.begin_shutdown()
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
