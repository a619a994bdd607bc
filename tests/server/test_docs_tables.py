"""docs/serve.md's table of request fields is checked against what the server's schemas accept and refuse,
so the docs cannot drift from the code: every field an endpoint declares is documented for it, every field
the code refuses has a "refused" cell, no field documented as simply served is refused, the SAFE knobs are
listed exactly, and each documented refusal is a 400 naming the field when sent to a running server."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from safe_engine.server.responses import _REFUSED as RESPONSES_REFUSED
from safe_engine.server.responses import ResponsesRequest
from safe_engine.server.schemas import (
    SAFE_KNOBS,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
)

from .conftest import KEY, MODEL

ROOT = Path(__file__).resolve().parents[2]
SERVE_MD = (ROOT / "docs" / "serve.md").read_text()
README = (ROOT / "README.md").read_text()
HEADER = "| field | endpoints | semantics for an ensemble | refused, and why |"
ENDPOINTS = {"chat": ChatCompletionRequest, "compl.": CompletionRequest, "resp.": ResponsesRequest}
ROUTES = {"chat": "/v1/chat/completions", "compl.": "/v1/completions", "resp.": "/v1/responses"}
MINIMAL = {
    "chat": {"messages": [{"role": "user", "content": "Hi"}]},
    "compl.": {"prompt": "Hi"},
    "resp.": {"input": "Hi"},
}


def documented() -> dict[tuple[str, str], str]:
    """(endpoint, field) -> the row's "refused, and why" cell, for every row of the fields table."""
    start = SERVE_MD.index(HEADER)
    rows: dict[tuple[str, str], str] = {}
    for line in SERVE_MD[start:].splitlines()[2:]:
        if not line.strip().startswith("|"):
            break
        names, endpoints, _, refused = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        if names == "an unknown field":  # the catch-all row: test_bad_input sends unknown fields
            continue
        fields = {m.group(1) for m in re.finditer(r"`([A-Za-z_]+)[^`]*`", names)}
        at = list(ENDPOINTS) if endpoints.startswith("all") else [e for e in ENDPOINTS if e in endpoints]
        assert fields and at, f"a row of the fields table names no field or no endpoint: {line}"
        for endpoint in at:
            for field in fields:
                rows[(endpoint, field)] = rows.get((endpoint, field), "") + refused
    return rows


def declared(endpoint: str) -> set[str]:
    return {f.alias or name for name, f in ENDPOINTS[endpoint].model_fields.items()}


def refused_by_code(endpoint: str) -> set[str]:
    """The fields the endpoint refuses at some value (beyond plain type and range checks)."""
    out = {name for name in UNSUPPORTED if name in declared(endpoint)}
    if endpoint == "resp.":
        out |= set(RESPONSES_REFUSED) | {"store", "include", "truncation"}
    return out


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_every_declared_field_is_documented_for_its_endpoint(endpoint):
    rows = documented()
    missing = sorted(f for f in declared(endpoint) if (endpoint, f) not in rows)
    assert not missing, f"{endpoint} accepts {missing}, which docs/serve.md's fields table does not list"


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_documented_refusals_are_the_codes(endpoint):
    rows = documented()
    code = refused_by_code(endpoint)
    silent = sorted(f for f in code if not rows.get((endpoint, f)))
    assert not silent, f"{endpoint} refuses {silent}, but docs/serve.md gives them no 'refused' cell"
    for field in declared(endpoint) - code:
        cell = rows.get((endpoint, field), "")
        assert not cell.startswith("refused"), f"docs/serve.md says {endpoint} refuses {field}; the code serves it"


def test_the_safe_knobs_are_listed_exactly():
    listed = re.search(r"\*\*SAFE knobs\*\*[^—]*—(.*?)—", SERVE_MD, re.S)
    assert listed, "docs/serve.md lists the SAFE knobs between dashes"
    assert re.findall(r"`([a-z_]+)`", listed.group(1)) == list(SAFE_KNOBS)


def test_the_readme_claims_no_refusal_the_server_does_not_make():
    """The README leaves the per-field tables to docs/serve.md; a field it calls refused must be refused."""
    for line in README.splitlines():
        if "refused" in line.lower() and line.startswith("|"):
            for field in re.findall(r"`([a-z_]+)`", line):
                assert any(field in refused_by_code(e) for e in ENDPOINTS), f"README: {field} is not refused"


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_each_refused_field_is_a_400_naming_it(served, endpoint):
    headers = {"Authorization": f"Bearer {KEY}"}
    for field in sorted(refused_by_code(endpoint)):
        body = {"model": MODEL, **MINIMAL[endpoint], field: "not-neutral"}
        res = httpx.post(served.v1.removesuffix("/v1") + ROUTES[endpoint], json=body, headers=headers, timeout=30)
        assert res.status_code == 400, (endpoint, field, res.text)
        assert res.json()["error"]["param"] == field, (endpoint, field, res.text)
