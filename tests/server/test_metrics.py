"""GET /metrics (Prometheus text) and the bounded queue: with one request decoding (held at a gate in its
model's forward pass) and one waiting, a third is refused with a 503 and Retry-After, and the metrics count
all of it."""

from __future__ import annotations

import threading

import httpx
import pytest
from openai import InternalServerError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from safe_engine import Ensemble, GenerationConfig
from safe_engine.server import BackgroundServer, create_app

from .conftest import wait_for

USER = [{"role": "user", "content": "Name a prime number."}]
TOKENS = 6


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    res = httpx.get(f"{url}/metrics", timeout=10)
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(res.text)
        for s in family.samples
    }


@pytest.fixture
def gated(model_dirs):
    """A server with a batch of one and a queue of one, whose drafter waits at `gate` in every forward pass."""
    ens = Ensemble.from_pretrained(model_dirs, max_batch_size=1)
    gate = threading.Event()
    model = ens.drafter.model
    forward = model.forward

    def gated_forward(*args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return forward(*args, **kwargs)

    model.forward = gated_forward
    app = create_app(ens, defaults=GenerationConfig(max_new_tokens=TOKENS), max_queue=1)
    server = BackgroundServer(app).start()
    try:
        yield server.url, ens, gate
    finally:
        gate.set()
        server.stop()


def test_a_full_queue_is_a_503_with_retry_after_and_counted(gated):
    url, ens, gate = gated
    replies: dict[str, httpx.Response] = {}

    def ask(name: str) -> None:
        replies[name] = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}, timeout=60)

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    wait_for(lambda: ens.running_requests == 1, what="the first request decoding")
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    wait_for(lambda: ens.waiting_requests == 1, what="the second request waiting")

    held = scrape(url)
    assert held["safe_queue_depth", ()] == 1 and held["safe_running_requests", ()] == 1
    assert held["safe_batch_occupancy", ()] == 1.0 and held["safe_max_batch_size", ()] == 1

    full = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}, timeout=10)
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "queue_full" and full.json()["error"]["type"] == "server_error"
    with pytest.raises(InternalServerError) as err:  # what the openai SDK sees (it would retry after 1 s)
        OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).completions.create(model=None, prompt="Hi")
    assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"

    gate.set()
    first.join(60)
    second.join(60)
    assert replies["first"].status_code == replies["second"].status_code == 200
    bodies = [replies[k].json() for k in ("first", "second")]

    after = scrape(url)
    chat = "/v1/chat/completions"
    assert after["safe_requests_total", (("endpoint", chat), ("status", "200"))] == 2
    assert after["safe_requests_total", (("endpoint", chat), ("status", "503"))] == 1
    assert after["safe_requests_total", (("endpoint", "/v1/completions"), ("status", "503"))] == 1
    assert after["safe_queue_rejected_requests_total", ()] == 2
    assert after["safe_generated_tokens_total", ()] == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert after["safe_prompt_tokens_total", ()] == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert after["safe_ensembled_tokens_total", ()] == sum(b["safe"]["ensembled_tokens"] for b in bodies)
    assert after["safe_time_to_first_token_seconds_count", ()] == 2
    assert after["safe_time_per_output_token_seconds_count", ()] == sum(
        b["usage"]["completion_tokens"] > 1 for b in bodies
    )
    assert after["safe_queue_depth", ()] == 0 and after["safe_running_requests", ()] == 0


def test_more_choices_than_batch_and_queue_hold_is_a_400(gated):
    url, _, gate = gated
    gate.set()
    res = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "n": 3}, timeout=30)
    assert res.status_code == 400 and res.json()["error"]["param"] == "n"
    assert httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "n": 2}, timeout=30).status_code == 200


def test_each_app_has_its_own_registry(served):
    """Two apps in one process (the package's server and this one) count separately."""
    app = create_app(served.ens)
    assert app.state.safe.metrics.registry is not served.server.server.config.app.state.safe.metrics.registry
    before = scrape(served.url).get(("safe_requests_total", (("endpoint", "/health"), ("status", "200"))), 0)
    served.health()
    after = scrape(served.url)[("safe_requests_total", (("endpoint", "/health"), ("status", "200")))]
    assert after == before + 1
    assert scrape(served.url)[("safe_requests_total", (("endpoint", "/metrics"), ("status", "200")))] >= 2
