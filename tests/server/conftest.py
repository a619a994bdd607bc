"""A real server for the client tests: uvicorn on a free 127.0.0.1 port, serving tiny random models that
were saved to a temp dir and loaded back by spec, as `safe-engine serve` loads them.

The server runs in a thread of the test process, so a test can compare each response with the in-process
result of the very same `Ensemble` and check that no request keeps a KV cache once it has ended.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from safe_engine import Ensemble, GenerationConfig
from safe_engine.server import BackgroundServer, create_app  # the test extra installs the [server] extra
from tests.conftest import one_torch_thread, save_tiny_member

KEY = "sk-test-0123456789"
MODEL = "tiny-safe"
MAX_BODY = 256 * 1024
DEFAULT_TOKENS = 12
# Qwen2.5 (byte-level BPE, template renders tools) drafts; Mistral v0.3 (SentencePiece, template renders
# tools) verifies: two tokenizer families, both with chat templates.
FAMILIES = (("qwen2.5-7b-instruct", 1), ("mistral-7b-instruct-v0.3", 2))


_one_torch_thread = pytest.fixture(scope="package", autouse=True)(one_torch_thread)  # before module fixtures


@pytest.fixture(scope="package")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The tiny members saved as Hugging Face directories (what a user passes to `-m`)."""
    return save_tiny_members(tmp_path_factory.mktemp("tiny-models"))


def save_tiny_members(root: Path) -> list[str]:
    """Save each of FAMILIES' tiny members under `root` as a Hugging Face directory; their paths, in order
    (also benchmarks/soak.py's models)."""
    return [save_tiny_member(name, seed, root / f"{name}-{seed}") for name, seed in FAMILIES]


@dataclass
class Served:
    url: str  # base URL, without /v1
    ens: Ensemble
    server: BackgroundServer

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """/health once no request is running or waiting, and the engine holds no request's caches."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if health["running"] == 0 and health["waiting"] == 0 and self.ens.open_requests == 0:
                return health
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still in flight after {timeout} s: {health}")
            time.sleep(0.05)


@pytest.fixture(scope="package")
def served(model_dirs: list[str]) -> Iterator[Served]:
    with serving(Ensemble.from_pretrained(model_dirs)) as s:
        yield s


@contextmanager
def serving(ens: Ensemble) -> Iterator[Served]:
    """A real server over `ens` (the `served` fixture's: MODEL, KEY, DEFAULT_TOKENS, batches of 8), stopped
    on exit."""
    app = create_app(
        ens,
        model_name=MODEL,
        api_key=KEY,
        defaults=GenerationConfig(max_new_tokens=DEFAULT_TOKENS),
        max_batch_size=8,
        max_body_bytes=MAX_BODY,
    )
    server = BackgroundServer(app).start()
    try:
        yield Served(server.url, ens, server)
    finally:
        server.stop()


# -- caches ----------------------------------------------------------------------------------------------------
def live_caches() -> int:
    from transformers import DynamicCache

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is DynamicCache)


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
