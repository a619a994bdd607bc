"""`SafeLLM`: a SAFE ensemble as a LangChain text-completion model (`BaseLLM`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from ._base import SafeParams, awith_result, with_result


class SafeLLM(SafeParams, BaseLLM):
    """Raw-text completion by a SAFE ensemble of causal LMs with different tokenizers.

    Build it from an existing `Ensemble` or from model specs (loaded on first use)::

        llm = SafeLLM(models=["qwen2.5-coder-0.5b", "smollm2-135m"], max_new_tokens=64)
        llm.invoke("The capital of France is")

    Every generation knob (`method`, `aggregation`, `draft_length`, `top_k`, `sharpening`,
    `sharpen_threshold`, `max_new_tokens`/`max_tokens`, `temperature`, `top_p`, `do_sample`, `seed`) is a
    field and can be overridden per call as a keyword argument. Streaming yields verified text only, and
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
        options = self._engine_options(stop, dict(kwargs))
        ens = self.get_ensemble()
        generations = []
        for prompt in prompts:
            info: dict[str, Any] | None = None
            text = ""
            for delta, result in with_result(lambda p=prompt: ens.stream(p, **options)):
                if delta and run_manager:
                    run_manager.on_llm_new_token(delta)
                if result is not None:
                    text, info = result.text, self._generation_info(result, ens)
            generations.append([Generation(text=text, generation_info=info)])
        return LLMResult(generations=generations, llm_output={"model_name": self.ensemble_name})

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        options = self._engine_options(stop, dict(kwargs))
        ens = await self.aget_ensemble()
        generations = []
        for prompt in prompts:
            info: dict[str, Any] | None = None
            text = ""
            async for delta, result in awith_result(lambda p=prompt: ens.astream(p, **options)):
                if delta and run_manager:
                    await run_manager.on_llm_new_token(delta)
                if result is not None:
                    text, info = result.text, self._generation_info(result, ens)
            generations.append([Generation(text=text, generation_info=info)])
        return LLMResult(generations=generations, llm_output={"model_name": self.ensemble_name})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        options = self._engine_options(stop, dict(kwargs))
        ens = self.get_ensemble()
        for delta, result in with_result(lambda: ens.stream(prompt, **options)):
            info = self._generation_info(result, ens) if result is not None else None
            chunk = GenerationChunk(text=delta, generation_info=info)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        options = self._engine_options(stop, dict(kwargs))
        ens = await self.aget_ensemble()
        async for delta, result in awith_result(lambda: ens.astream(prompt, **options)):
            info = self._generation_info(result, ens) if result is not None else None
            chunk = GenerationChunk(text=delta, generation_info=info)
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
