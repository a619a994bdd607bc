# Every target builds .venv from nothing when it is missing. torch is pinned and installed first:
# an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

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
