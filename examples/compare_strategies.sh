#!/usr/bin/env bash
# Compare every strategy on the same model, seed and batch: step time, tokens/s, activation bytes
# per token, peak memory, first-step loss agreement, and (with a budget) the longest trainable
# sequence. Writes bench_out/results.{json,md} and PNG plots. About 10-20 minutes on 2 CPU cores.
#
#   bash examples/compare_strategies.sh                       # CPU, llama-tiny, 2 ranks
#   MODEL=gpt-tiny SEQS=2048,4096,8192 bash examples/compare_strategies.sh
#   # on one GPU: per-rank figures of an 8-way SP job (communication excluded)
#   DEVICE=cuda MODEL=llama-3.2-1b EXTRA="--bf16 --simulate-world-size 8 --memory-budget-gb 130" \
#     STRATEGIES=ulysses,autosp,autosp-nosac bash examples/compare_strategies.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-llama-tiny}
SEQS=${SEQS:-2048,4096}
STRATEGIES=${STRATEGIES:-none,ulysses,ring,autosp,autosp-nosac}
NPROC=${NPROC:-2}
OUT=${OUT:-bench_out}
DEVICE_FLAG=${DEVICE:+--device $DEVICE}
python tools/benchmark_sp.py --model "$MODEL" --strategies "$STRATEGIES" --seq-lengths "$SEQS" \
  --nproc "$NPROC" --output "$OUT" --memory-budget-gb "${BUDGET_GB:-16}" $DEVICE_FLAG ${EXTRA:-}
