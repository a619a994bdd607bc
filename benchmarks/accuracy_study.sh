#!/usr/bin/env bash
# Issue 46's study (docs/accuracy.md#choosing-the-default-issue-46-the-rule-written-before-the-500-problem-rows),
# resumable: run it again after an interruption and finished (row, problem) pairs are skipped.
#
#   LIMIT=150 bash benchmarks/accuracy_study.sh   # the first 150 problems of every task (the check first)
#   LIMIT=500 bash benchmarks/accuracy_study.sh   # then the rest of the 500
#
# Two lanes of one llama.cpp thread each (decoding is memory-bound: two 1-thread processes do more than one
# 2-thread process); each invocation runs one row, so a chunk of 32 answers is written as soon as it is
# decoded and an interruption (kill the python processes: they stop as Ctrl-C does) loses at most that chunk.
# Pin the engine: run it from a checkout of one commit (git worktree add --detach DIR COMMIT; cd DIR) with
# OUT pointing at the study folder of the main tree. Each run's commit and CPU go to OUT/timings.jsonl.
set -u
OUT=${OUT:-benchmarks/results/accuracy/study-46}
LIMIT=${LIMIT:-150}
TASKS=${TASKS:-gsm8k mmlu-redux arc}
PYTHON=${PYTHON:-python}
# KV positions each member's context shares among the 8 answers decoded at once: 8 GSM8K answers of up to 1,024
# tokens and their prompts (the scheduler admits fewer at once where they would not fit)
POSITIONS=${POSITIONS:-12288}

lane() {
    local part=$1
    shift
    for task in $TASKS; do
        for row in "$@"; do
            "$PYTHON" benchmarks/accuracy.py --task "$task" --limit "$LIMIT" --threads 1 --backend llama.cpp \
                --positions "$POSITIONS" --configs "$row" --out "$OUT" --jsonl "$OUT/$task.$part.jsonl" || return 1
        done
    done
}

lane a "qwen alone" "UniTE+SAFE" "GaC+SAFE" &
lane b "smollm2 alone" "UniTE+SAFE, loop steering" "GaC+SAFE, loop steering" &
wait
