"""`SafeLLM`: a SAFE ensemble as a LangChain text-completion model (`BaseLLM`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from safe_engine import GenerationResult, Request, StreamEvent

from ._base import SafeParams


class SafeLLM(SafeParams, BaseLLM):
    """Raw-text completion by a SAFE ensemble of causal LMs with different tokenizers.

    Build it from an existing `Ensemble` or from model specs (loaded on first use)::

        llm = SafeLLM(models=["qwen2.5-coder-0.5b", "smollm2-135m"], max_new_tokens=64)
        llm.invoke("The capital of France is")

    Every generation knob (`method`, `aggregation`, `draft_length`, `top_k`, `sharpening`,
    `sharpen_threshold`, `max_new_tokens`/`max_tokens`, `temperature`, `top_p`, `do_sample`, `seed`,
    `gates`, `trace`, `timeout_s`/`timeout`: every `GenerationConfig` field) is a field and can be
    overridden per call as a keyword argument; `timeout` is enforced (`GenerationTimeout`).
    `preset="paper-unite"` / `"paper-gac"` (a field or per call) is the paper's configuration under the
    fields and options set explicitly (`safe_engine.presets`). Streaming yields verified text only, and
    `on_llm_new_token` receives exactly those deltas. `generation_info` carries `finish_reason`,
    `ensemble_rate` (the paper's E/T) and the full `stats`.
    """

    @property
    def _llm_type(self) -> str:
        return "safe-ensemble"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._safe_identifying_params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**self._ls_params("llm", stop, kwargs))

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        streams = [self._holder.events(self._request(stop, kwargs, prompt=p)) for p in prompts]  # all start: one batch
        generations = []
        for events in streams:
            for event in events:
                if event.delta and run_manager:
                    run_manager.on_llm_new_token(event.delta)
            assert event.result is not None, "the last event carries the result (an error raises instead)"
            generations.append([self._generation(event.result)])
        return LLMResult(generations=generations, llm_output={"model_name": self.ensemble_name})

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        requests = [self._request(stop, kwargs, prompt=p) for p in prompts]  # all checked before any starts

        async def one(request: Request) -> Generation:  # the prompts decode concurrently: one batch
            async for event in await self._holder.aevents(request):
                if event.delta and run_manager:
                    await run_manager.on_llm_new_token(event.delta)
            assert event.result is not None, "the last event carries the result (an error raises instead)"
            return self._generation(event.result)

        generations = [[g] for g in await asyncio.gather(*(one(r) for r in requests))]
        return LLMResult(generations=generations, llm_output={"model_name": self.ensemble_name})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        offset = 0
        for event in self._holder.events(self._request(stop, kwargs, prompt=prompt)):
            chunk = self._chunk(event, offset)
            offset += len(event.delta)
            if run_manager:
                run_manager.on_llm_new_token(event.delta, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        offset = 0
        async for event in await self._holder.aevents(self._request(stop, kwargs, prompt=prompt)):
            chunk = self._chunk(event, offset)
            offset += len(event.delta)
            if run_manager:
                await run_manager.on_llm_new_token(event.delta, chunk=chunk)
            yield chunk

    def _generation(self, result: GenerationResult) -> Generation:
        return Generation(text=result.text, generation_info=self._generation_info(result))

    _chat_logprobs: ClassVar[bool] = (
        False  # OpenAI's legacy completions shape, as langchain_openai's OpenAI LLM reports it
    )

    def _chunk(self, event: StreamEvent, offset: int = 0) -> GenerationChunk:
        """The chunk of one event; `offset`: the characters streamed before it (the logprobs' text_offset)."""
        if event.result is not None:
            rest = None if event.result.logprobs is None else event.logprobs or []
            info: dict[str, Any] | None = self._generation_info(event.result, rest, offset)
        else:
            info = self._logprobs_info(event.logprobs, offset) if event.logprobs else None
        return GenerationChunk(text=event.delta, generation_info=info)
