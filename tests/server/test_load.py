"""Load: 16 concurrent streaming clients x 4 requests each, every stream equal to its solo result, and
nothing left behind (no running request, no request holding KV caches)."""

from __future__ import annotations

import asyncio
import time

from openai import AsyncOpenAI

from .conftest import KEY, MODEL, live_caches

CLIENTS = 16
REQUESTS = 4
TOKENS = 10
TOPICS = ["rivers", "owls", "prime numbers", "tea", "glaciers", "jazz", "chess", "bread"]


def request(client: int, k: int) -> tuple[list[dict], dict]:
    """Distinct requests (messages, options), some with SAFE knobs, a stop string or seeded sampling."""
    messages = [
        {"role": "user", "content": f"Client {client}, question {k}: tell me about {TOPICS[(client + k) % 8]}."}
    ]
    variant = (client + k) % 4
    options: dict = {"max_new_tokens": TOKENS}
    if variant == 1:
        options["method"] = "every_token"
    elif variant == 2:
        options.update(do_sample=True, temperature=0.8, seed=client * 10 + k)
    elif variant == 3:
        options["stop"] = ("e",)
    return messages, options


def openai_kwargs(options: dict) -> dict:
    kwargs: dict = {"max_tokens": options["max_new_tokens"]}
    if "method" in options:
        kwargs["extra_body"] = {"method": options["method"]}
    if options.get("do_sample"):
        kwargs.update(temperature=options["temperature"], seed=options["seed"])
    if "stop" in options:
        kwargs["stop"] = list(options["stop"])
    return kwargs


def test_16_concurrent_streaming_clients(served):
    solo = {}
    for c in range(CLIENTS):
        for k in range(REQUESTS):
            messages, options = request(c, k)
            solo[c, k] = served.ens.generate(messages=messages, **options)

    async def client_run(c: int, api: AsyncOpenAI) -> list[tuple[int, str, str, dict]]:
        got = []
        for k in range(REQUESTS):
            messages, options = request(c, k)
            stream = await api.chat.completions.create(
                model=MODEL,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                **openai_kwargs(options),
            )
            text, finish, safe = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                else:
                    safe = chunk.model_extra["safe"]
            got.append((k, text, finish, safe))
        return got

    async def main() -> tuple[list, float, int]:
        api = AsyncOpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=120)
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, served.ens.open_requests)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        started = time.perf_counter()
        try:
            results = await asyncio.gather(*(client_run(c, api) for c in range(CLIENTS)))
        finally:
            watcher.cancel()
        await api.close()
        return results, time.perf_counter() - started, peak

    results, wall, peak = asyncio.run(main())
    assert sum(len(r) for r in results) == CLIENTS * REQUESTS
    for c, runs in enumerate(results):
        for k, text, finish, safe in runs:
            expected = solo[c, k]
            assert text == expected.text, (c, k)
            assert finish == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
            assert safe["tokens"] == expected.stats.tokens and safe["finish_reason"] == expected.finish_reason
    assert peak > 1, "the requests never overlapped"
    health = served.wait_idle()
    assert health["open_requests"] == 0
    assert live_caches() == 0
    print(f"\n{CLIENTS * REQUESTS} streams in {wall:.1f} s, up to {peak} requests decoded together")
