#!/usr/bin/env bash
# A quick end-to-end run on a laptop or CI machine: 2 CPU processes, tiny Llama, synthetic data,
# each strategy for a few steps. Prints Megatron-style log lines and writes JSON metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/cpu_smoke}
mkdir -p "$OUT"
COMMON="--model llama-tiny --mock-data --seq-length 512 --global-batch-size 4 --train-iters 10
        --log-interval 2 --eval-iters 0 --lr-warmup-iters 2"
for strategy in "" --ulysses --ring --autosp; do
  name=${strategy:-dp}; name=${name#--}
  echo "== $name"
  torchrun --nproc-per-node 2 pretrain.py $COMMON $strategy --metrics-file "$OUT/$name.jsonl"
done
