#!/usr/bin/env bash
# Issue 46, item 4: the drafter alone and the default, through lm-evaluation-harness unmodified, on the same
# problems, so the study's figures can be set beside published ones. For each configuration: `safe-engine serve`
# over the demo pair (llama.cpp members by default) on a free local port, lm-eval's `local-completions` model on
# `gsm8k_local` (GSM8K as lm-eval defines it, 3-shot, a local copy of 40 test problems), greedy, lm-eval's default
# max_gen_toks (256), one request at a time (llama.cpp's kernels are not batch-invariant: alone, a reply is the
# engine's solo reply), then the server stops. Results and samples go to OUT/CONFIG/.
#
#   bash benchmarks/lm_eval/compare.sh            # from the repository root
set -eu
OUT=${OUT:-benchmarks/results/lm_eval_46}
PYTHON=${PYTHON:-.venv/bin/python}
LIMIT=${LIMIT:-40}
MODELS=(-m qwen2.5-coder-0.5b -m smollm2-135m)
declare -A CONFIGS=([qwen-alone]="--method single" [default]="")

for name in qwen-alone default; do
    port=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    # shellcheck disable=SC2086  # the configuration's flags are words
    "$PYTHON" -m safe_engine serve "${MODELS[@]}" ${CONFIGS[$name]} --port "$port" --max-batch-size 1 \
        > "/tmp/lm_eval_serve_$name.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null' EXIT
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
        sleep 1
    done
    mkdir -p "$OUT/$name"
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OPENAI_API_KEY=none "$PYTHON" -m lm_eval --model local-completions \
        --model_args "model=qwen2.5-coder-0.5b+smollm2-135m,base_url=http://127.0.0.1:$port/v1/completions,tokenizer_backend=None,num_concurrent=1,max_retries=1,timeout=1800" \
        --tasks gsm8k_local --include_path benchmarks/lm_eval --limit "$LIMIT" \
        --output_path "$OUT/$name" --log_samples | tee "$OUT/$name/stdout.txt"
    kill "$server"
    wait "$server" || true
    trap - EXIT
done
