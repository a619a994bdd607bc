# Every target builds .venv from nothing when it is missing. torch is pinned and installed first:
# an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# llama.cpp is built from source by pip. A native build (-march=native) crashed in llama_decode on a Xeon whose
# CPUID reports AMX, and this project's machines change kind (AMD EPYC with AVX2 only; Intel Xeon with AVX-512):
# one portable AVX2 build runs on both (docs/llamacpp.md measures what it costs). Your own CMAKE_ARGS win.
CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
export CMAKE_ARGS
CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)
export CMAKE_BUILD_PARALLEL_LEVEL

.PHONY: demo test test-unit lint bench eval clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/safe-engine models fetch qwen2.5-coder-0.5b smollm2-135m
	$(BIN)/safe-engine generate --chat --stream -m qwen2.5-coder-0.5b -m smollm2-135m --max-new-tokens 96 \
		"Explain in two sentences why the sky is blue."

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy safe_engine langchain_safe llamaindex_safe
	$(BIN)/python -m pytest -q -ra --durations=15

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra tests/unit

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python benchmarks/speed.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
