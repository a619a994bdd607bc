"""/v1/placement: the server's door to `Ensemble.placement` and `Ensemble.measure_placement` (the load a server
was started under may change while it runs)."""

from __future__ import annotations

import httpx
import torch

from safe_engine import Ensemble
from tests.conftest import tiny_member
from tests.server.conftest import KEY, serving

AUTH = {"Authorization": f"Bearer {KEY}"}


def test_the_placement_route_shows_and_measures_again_and_waits_for_open_requests(machine, fake_clock):
    machine(2)
    fake_clock({2: 1 / 64})
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2)])
    with serving(ens) as srv:
        url = f"{srv.v1}/placement"
        assert httpx.get(url, timeout=10).status_code == 401  # a /v1 route: the key is needed
        shown = httpx.get(url, headers=AUTH, timeout=10).json()
        assert shown["object"] == "placement" and shown["chosen_by"] == "engine" and shown["cores"] == 2
        assert shown["describe"] == ens.placement.describe() and "step 1t 16 ms, 2t 16 ms" in shown["describe"]

        fake_clock({2: 1 / 32})  # the machine got slower: measured again on POST only
        assert httpx.get(url, headers=AUTH, timeout=10).json() == shown
        measured = httpx.post(url, headers=AUTH, timeout=60).json()
        assert "step 1t 31 ms, 2t 31 ms" in measured["describe"] and measured["describe"] == ens.placement.describe()
        assert measured["threads"] == {"alone": 1, "verifying": 1, "batch": 1, "drafter": 1, "verifiers": 1}

        stream = ens.stream("The quick brown fox", max_new_tokens=40)
        next(iter(stream))  # a request open on the engine
        refused = httpx.post(url, headers=AUTH, timeout=10)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "requests_open"
        before = ens.placement
        stream.close()
        srv.wait_idle()
        assert ens.placement is before  # nothing was measured while the request was open
        assert httpx.post(url, headers=AUTH, timeout=60).status_code == 200


def test_the_users_thread_count_is_shown_and_kept_on_post(monkeypatch):
    """Where the user chose torch's threads (OMP_NUM_THREADS), the route shows that choice, and POST times
    nothing and keeps it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2)])
    with serving(ens) as srv:
        url = f"{srv.v1}/placement"
        for reply in (httpx.get(url, headers=AUTH, timeout=10), httpx.post(url, headers=AUTH, timeout=60)):
            body = reply.json()
            assert reply.status_code == 200 and body["chosen_by"] == "user", body
            assert body["describe"].startswith(f"user: {torch.get_num_threads()} thread(s)")
