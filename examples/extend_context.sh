#!/usr/bin/env bash
# Start from a Hugging Face checkpoint, continue pretraining at 4x its context with YaRN under
# AutoSP, export a directory transformers loads.
#
#   HF_DIR=/path/to/Llama-3.2-1B DATA=corpus.jsonl NPROC=8 bash examples/extend_context.sh
#
# Without HF_DIR it runs on CPU end to end: transformers makes a tiny random Llama (with a BPE
# tokenizer trained by `tokenizers` on Python standard-library sources, which are also the corpus),
# then the same steps run on it. Variables: HF_DIR, DATA (jsonl with a "text" key), FACTOR (4),
# NPROC (2), TRAIN_ITERS (4), AUTOSP_BACKEND (inductor; the CPU demo defaults to aot_eager), OUT,
# CHECK (1 in the CPU demo: compare the export's logits with ours in transformers; it loads both
# models in fp32 on the CPU, so think twice for an 8B model).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/extend_context}
FACTOR=${FACTOR:-4}
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-4}
mkdir -p "$OUT"

if [[ -z "${HF_DIR:-}" ]]; then
  HF_DIR=$OUT/tiny-llama
  AUTOSP_BACKEND=${AUTOSP_BACKEND:-aot_eager}
  CHECK=${CHECK:-1}
  echo "== 0. a tiny Llama checkpoint made by transformers in $HF_DIR (context 128)"
  python - "$HF_DIR" "$OUT/corpus.jsonl" <<'EOF'
import json, os, sys, sysconfig
import torch, transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
out, corpus = sys.argv[1:]
root = sysconfig.get_paths()["stdlib"]
files = sorted(f for f in os.listdir(root) if f.endswith(".py"))[:60]
texts = [open(os.path.join(root, f), encoding="utf-8", errors="replace").read() for f in files]
with open(corpus, "w") as fh:
    for t in texts:
        fh.write(json.dumps({"text": t}) + "\n")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(texts, trainers.BpeTrainer(
    vocab_size=1024, special_tokens=["<|endoftext|>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=0)
transformers.LlamaForCausalLM(cfg).save_pretrained(out)
tok.save(os.path.join(out, "tokenizer.json"))
json.dump({"eos_token": "<|endoftext|>"}, open(os.path.join(out, "tokenizer_config.json"), "w"))
EOF
  DATA=${DATA:-$OUT/corpus.jsonl}
fi
AUTOSP_BACKEND=${AUTOSP_BACKEND:-inductor}
: "${DATA:?set DATA to a jsonl file with a \"text\" key}"

ORIGINAL=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['max_position_embeddings'])" \
           "$HF_DIR/config.json")
SEQ=$((ORIGINAL * FACTOR))
echo "== 1. tokenize $DATA with the checkpoint's own tokenizer"
python tools/preprocess_data.py --input "$DATA" --output-prefix "$OUT/data/corpus" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_DIR" --append-eod --no-progress

echo "== 2. continue pretraining at $SEQ tokens ($FACTOR x $ORIGINAL) with YaRN, sequence-parallel over $NPROC ranks"
torchrun --nproc-per-node "$NPROC" pretrain.py --hf-checkpoint "$HF_DIR" --autosp \
    --compile-backend "$AUTOSP_BACKEND" --data-path "$OUT/data/corpus_text_document" \
    --seq-length "$SEQ" --rope-scaling yarn --rope-scaling-factor "$FACTOR" \
    --rope-original-max-position-embeddings "$ORIGINAL" --micro-batch-size 1 --global-batch-size 2 \
    --train-iters "$TRAIN_ITERS" --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 1 --log-interval 1 \
    --eval-iters 0 --save "$OUT/checkpoints" --metrics-file "$OUT/metrics.jsonl"

echo "== 3. export to $OUT/hf"
python tools/export_hf.py --load "$OUT/checkpoints" --output "$OUT/hf"

if [[ "${CHECK:-0}" == 1 ]]; then
  echo "== 4. transformers loads the export: logits against ours at $SEQ tokens"
  python - "$OUT/checkpoints" "$OUT/hf" "$SEQ" <<'EOF'
import os, sys
import torch, transformers
sys.path.insert(0, os.getcwd())
from autosp_lm.models import build_model
from autosp_lm.training.checkpoint import find_checkpoint
from tools.export_hf import read_checkpoint
ckpt, out, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg, state, _ = read_checkpoint(find_checkpoint(ckpt))
ours = build_model(cfg)
ours.load_state_dict(state)
theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    mine = ours.eval()(ids)
    diff = (mine - theirs(input_ids=ids).logits).abs().max().item()
rel = diff / mine.abs().max().item()
print(f"max |logits ours - transformers| = {diff:.2e} ({rel:.1e} of the largest logit)")
assert rel < 1e-5, rel
EOF
fi
