"""Talk to `safe-engine serve` with ordinary OpenAI clients: the openai SDK, LangChain, LlamaIndex — offline.

    python examples/server_client.py                       # starts a server with the two demo models
    python examples/server_client.py --base-url http://127.0.0.1:8000/v1 --api-key KEY   # or uses yours

Without --base-url it runs `safe-engine serve -m qwen2.5-coder-0.5b -m smollm2-135m` on a free port of
127.0.0.1 with a random API key, waits for "Serving ...", and stops it (SIGINT) at the end. Then it asks
one question four ways: the openai SDK (with SAFE knobs as `extra_body` and the ensemble statistics from
the response's `safe` object), the SDK streaming, LangChain's `ChatOpenAI`, and LlamaIndex's `OpenAILike`.

Needs: pip install "langchain-safe[server,gguf]" openai langchain-openai llama-index-llms-openai-like
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time

from openai import OpenAI

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # the first is the drafter
QUESTION = "What is the capital of France? Answer in one sentence."
TOKENS = 32


def start_server(api_key: str) -> tuple[subprocess.Popen, str]:
    """`safe-engine serve` on a free port; returns the process and its /v1 URL once the members are loaded."""
    cmd = [sys.executable, "-m", "safe_engine", "serve", "--port", "0", "--api-key", api_key, "--max-new-tokens", "64"]
    for model in MODELS:
        cmd += ["-m", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:  # "Serving 'qwen2.5-coder-0.5b+smollm2-135m' at http://127.0.0.1:PORT/v1 ..."
        if line.startswith("Serving "):
            print(line.strip())
            return proc, line.split(" at ", 1)[1].split()[0]
    raise SystemExit(f"the server exited before it was ready (status {proc.wait()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server's /v1 URL (default: start one)")
    parser.add_argument("--api-key", default=os.environ.get("SAFE_ENGINE_API_KEY"))
    args = parser.parse_args()

    proc = None
    api_key = args.api_key or secrets.token_urlsafe(16)
    base_url = args.base_url
    if base_url is None:
        proc, base_url = start_server(api_key)
    try:
        client = OpenAI(base_url=base_url, api_key=api_key or "none", timeout=600)
        model = client.models.list().data[0].id
        print(f"Model: {model}")

        # 1. openai SDK; SAFE knobs travel as extra body fields, the statistics come back in `safe`
        started = time.perf_counter()
        res = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=TOKENS,
            extra_body={"method": "safe", "aggregation": "unite", "draft_length": 5},
        )
        safe = res.model_extra["safe"]
        print(f"openai SDK: {res.choices[0].message.content.strip()}")
        print(
            f"  [{res.usage.completion_tokens} tokens, {safe['ensembled_tokens']} ensembled "
            f"(E/T {safe['ensemble_rate']:.0%}), {safe['rounds']} rounds, forward passes {safe['forward_passes']}, "
            f"finish={res.choices[0].finish_reason}, {time.perf_counter() - started:.1f} s]"
        )

        # 2. streaming: verified text as it is produced, the stats on the last chunk
        print("streaming: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
            elif chunk.usage:
                rate = chunk.model_extra["safe"]["ensemble_rate"]
                print(f"\n  [{chunk.usage.completion_tokens} tokens, E/T {rate:.0%}]")

        # 3. LangChain
        from langchain_openai import ChatOpenAI

        chat = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_tokens=TOKENS, timeout=600)
        print(f"LangChain ChatOpenAI: {chat.invoke(QUESTION).content.strip()}")

        # 4. LlamaIndex
        from llama_index.llms.openai_like import OpenAILike

        llm = OpenAILike(
            model=model,
            api_base=base_url,
            api_key=api_key,
            is_chat_model=True,
            context_window=4096,
            max_tokens=TOKENS,
            temperature=0.0,
            timeout=600,
        )
        print(f"LlamaIndex OpenAILike: {llm.complete(QUESTION).text.strip()}")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)  # graceful: running streams end, then the server exits
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
