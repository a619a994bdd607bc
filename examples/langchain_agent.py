"""A tool-calling agent (LangChain `create_agent`) driven by a SAFE ensemble of two real models — offline.

    python examples/langchain_agent.py ["your question"]

`ChatSafe` ensembles Qwen2.5-Coder-0.5B-Instruct (drafter; its chat template renders the tool schemas)
with SmolLM2-135M-Instruct (verifier; its template knows no tools, so the engine describes them in its
system message). The agent calls the `multiply` tool, reads the result and answers. Small models are
weak at mental arithmetic but reliable at calling a tool when asked to, which is the point of the demo.
The demo models are fetched and converted into ~/.cache/safe-engine on first use.

One accommodation for 0.5B models: shown a conversation that already holds its own tool call and the
tool's response, Qwen2.5-Coder-0.5B calls the tool again instead of answering (measured: every system
prompt and phrasing we tried). The `answer_from_tool_results` middleware therefore asks for the final
answer as one plain question that quotes the tool results, without tools. Larger members do not need
it: drop the middleware and the standard ReAct loop runs unchanged.

Prints every tool call, every tool result, the final answer and the ensemble statistics per model call.
Needs: pip install "langchain-safe[langchain,gguf]" langchain
"""

from __future__ import annotations

import argparse
import time

import transformers
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_safe import ChatSafe

QUESTION = "What is 1234 * 5678? Use the multiply tool."
MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # the first is the drafter
SYSTEM = "You are a careful assistant. Use the tools for arithmetic, then state the result in one sentence."


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b and return the product."""
    return a * b


@tool
def add(a: int, b: int) -> int:
    """Add two integers a and b and return the sum."""
    return a + b


@wrap_model_call
def answer_from_tool_results(request, handler):
    """Once tools have answered, ask for the final answer as a plain question quoting their results."""
    results = [m for m in request.messages if isinstance(m, ToolMessage)]
    if not results:
        return handler(request)
    question = next(m.text for m in request.messages if isinstance(m, HumanMessage))
    facts = "\n".join(f"The {m.name} tool returned: {m.text}" for m in results)
    prompt = HumanMessage(f"Question: {question}\n{facts}\nAnswer the question in one sentence.")
    return handler(request.override(messages=[prompt], tools=[], system_message=None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    transformers.utils.logging.disable_progress_bar()
    began = time.perf_counter()
    chat = ChatSafe(models=MODELS, max_tokens=args.max_new_tokens)
    agent = create_agent(chat, tools=[multiply, add], system_prompt=SYSTEM, middleware=[answer_from_tool_results])

    print(f"Question: {args.question}", flush=True)
    final: AIMessage | None = None
    for update in agent.stream({"messages": [("user", args.question)]}, stream_mode="updates"):
        for step in update.values():
            for message in (step or {}).get("messages", []):
                if isinstance(message, AIMessage):
                    meta = message.response_metadata
                    stats = meta.get("stats", {})
                    for call in message.tool_calls:
                        print(f"Tool call: {call['name']}({call['args']})", flush=True)
                    for bad in message.invalid_tool_calls:
                        print(f"Invalid tool call: {bad['args']!r} ({bad['error']})", flush=True)
                    print(
                        f"  [model call: {stats.get('tokens')} tokens, E/T {meta.get('ensemble_rate', 0.0):.1%}, "
                        f"finish={meta.get('finish_reason')}, {stats.get('wall_time_s', 0.0):.1f} s]",
                        flush=True,
                    )
                    if not message.tool_calls:
                        final = message
                elif isinstance(message, ToolMessage):
                    print(f"Tool result: {message.name} -> {message.content}", flush=True)
    print(f"Answer: {final.text.strip() if final is not None else '(no answer)'}")
    print(f"Total: {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
