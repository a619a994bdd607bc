"""A tool-calling LlamaIndex agent (`FunctionAgent`) driven by a SAFE ensemble of two real models — offline.

    python examples/llamaindex_agent.py ["your question"]

`SafeLLM` is a LlamaIndex `FunctionCallingLLM`: it ensembles Qwen2.5-Coder-0.5B-Instruct (drafter; its
chat template renders the tool schemas) with SmolLM2-135M-Instruct (verifier; its template knows no
tools, so the engine describes them in its system message). The agent picks the `multiply` tool and its
arguments, the tool runs, and the ensemble states the answer. Small models are weak at mental arithmetic
but reliable at calling a tool when asked to, which is the point of the demo. The demo models are
fetched and converted into ~/.cache/safe-engine on first use.

One accommodation for 0.5B models, as in examples/langchain_agent.py: shown a conversation that already
holds its own tool call and the tool's response, Qwen2.5-Coder-0.5B calls the tool again instead of
answering (measured here: three identical calls in a row). So the tools are `return_direct` (the agent
stops at the first tool result) and the final answer is asked as one plain question that quotes the
result, without tools. Larger members do not need it: drop `return_direct` and the agent's own loop
answers.

Prints every tool call, every tool result, the ensemble statistics per model call and the final answer.
Needs: pip install "langchain-safe[llamaindex,gguf]"
"""

from __future__ import annotations

import argparse
import asyncio
import time

import transformers
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.core.tools import FunctionTool

from llamaindex_safe import SafeLLM

QUESTION = "What is 1234 * 5678? Use the multiply tool."
MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # the first is the drafter
SYSTEM = "You are a careful assistant. Use the tools for arithmetic, then state the result in one sentence."


def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b and return the product."""
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers a and b and return the sum."""
    return a + b


async def ask(llm: SafeLLM, agent: FunctionAgent, question: str, max_iterations: int) -> str:
    """Run the agent (printing its tool calls, their results and each model call's statistics), then
    have the ensemble state the answer from the tool results."""
    handler = agent.run(user_msg=question, max_iterations=max_iterations)
    results: list[ToolCallResult] = []
    async for event in handler.stream_events():
        if isinstance(event, AgentOutput):  # one model call
            for call in event.tool_calls:
                print(f"Tool call: {call.tool_name}({call.tool_kwargs})", flush=True)
            show_stats(event.raw)
        elif isinstance(event, ToolCallResult):
            print(f"Tool result: {event.tool_name} -> {event.tool_output.content}", flush=True)
            results.append(event)
    output = await handler
    if not results:  # the model answered without a tool
        return output.response.content or ""
    facts = "\n".join(f"The {r.tool_name} tool returned: {r.tool_output.content}" for r in results)
    prompt = f"Question: {question}\n{facts}\nAnswer the question in one sentence."
    reply = await llm.achat([ChatMessage(role=MessageRole.USER, content=prompt)])
    show_stats(reply.raw)
    return reply.message.content or ""


def show_stats(raw: dict | None) -> None:
    raw = raw or {}
    stats = raw.get("stats", {})
    for bad in raw.get("invalid_tool_calls", []):
        print(f"Invalid tool call: {bad['arguments']!r} ({bad['error']})", flush=True)
    print(
        f"  [model call: {stats.get('tokens')} tokens, E/T {stats.get('ensemble_rate', 0.0):.1%}, "
        f"finish={raw.get('finish_reason')}, {stats.get('wall_time_s', 0.0):.1f} s]",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-iterations", type=int, default=3, help="model calls the agent may make")
    args = parser.parse_args()

    transformers.utils.logging.disable_progress_bar()
    began = time.perf_counter()
    llm = SafeLLM(models=MODELS, max_new_tokens=args.max_new_tokens)
    # The docstring alone as the description: LlamaIndex's default puts the signature first
    # ("multiply(a: int, b: int) -> int\n..."), and the 0.5B drafter then copies the schema as arguments.
    tools = [FunctionTool.from_defaults(f, description=f.__doc__, return_direct=True) for f in (multiply, add)]
    agent = FunctionAgent(tools=tools, llm=llm, system_prompt=SYSTEM)

    print(f"Question: {args.question}", flush=True)
    answer = asyncio.run(ask(llm, agent, args.question, args.max_iterations))
    print(f"Answer: {answer.strip()}")
    print(f"Total: {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
