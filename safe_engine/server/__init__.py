"""An OpenAI-compatible HTTP server for an Ensemble (`safe-engine serve`; needs the `[server]` extra).

`create_app(ensemble)` builds the FastAPI app; `BackgroundServer(app)` runs it in a thread. Both are
imported on first use, so `import safe_engine.server` works without FastAPI installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackgroundServer", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "BackgroundServer":
        from .runner import BackgroundServer

        return BackgroundServer
    raise AttributeError(f"module 'safe_engine.server' has no attribute {name!r}")
