#!/usr/bin/env python
"""Export a training checkpoint as a Hugging Face directory transformers loads.

    python tools/export_hf.py --load checkpoints --output llama-extended
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('llama-extended')"

``--load`` is a ``--save`` directory (the iteration in its ``latest`` tracker, or ``--iteration``)
or one ``iter_NNNNNNN`` directory. Writes ``config.json`` (shapes, RoPE scaling, norm eps, tied
embeddings from the checkpoint's model config), ``model.safetensors`` (sharded above
``--max-shard-size``, with ``model.safetensors.index.json``) and, when the run used a Hugging
Face tokenizer (``--tokenizer-type HuggingFaceTokenizer``, e.g. the one of ``--hf-checkpoint``),
its ``tokenizer.json`` and config files. A SentencePiece tokenizer is not exported (transformers
has no loader that reproduces ours exactly).

The model weights are read from the checkpoint memory-mapped, so the optimizer state stored beside
them is never loaded. Sharded checkpoints (``--ckpt-format torch_dist``, any world size) are read
in this one process: only the model's tensors, assembled from every rank's shards.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from autosp_lm.config.cli import HelpFormatter  # noqa: E402
from autosp_lm.config.run_config import stored_config  # noqa: E402
from autosp_lm.models.config import ModelConfig  # noqa: E402
from autosp_lm.models.hf import HFCheckpointError, save_hf_checkpoint  # noqa: E402
from autosp_lm.training.checkpoint import (META_FILE, MODEL_FILE, CheckpointError,  # noqa: E402
                                           find_checkpoint, iter_dirname)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (a --save DIR or one iter_* directory)")
    p.add_argument("--output", required=True, help="Hugging Face directory to write")
    p.add_argument("--iteration", type=int, help="iteration to export (default: the `latest` tracker's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the stored weights")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)")
    p.add_argument("--tokenizer-model",
                   help="Hugging Face tokenizer.json / directory to include (default: the run's, when it "
                        "used a HuggingFaceTokenizer)")
    return p.parse_args(argv)


def checkpoint_dir(load: str, iteration=None) -> str:
    if os.path.isfile(os.path.join(load, META_FILE)):
        return load
    if iteration is not None:
        path = os.path.join(load, iter_dirname(iteration))
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} does not exist")
        return path
    path = find_checkpoint(load)
    if path is None:
        raise CheckpointError(f"--load {load}: no checkpoint found (no `latest` tracker, no iter_* directories)")
    return path


def read_checkpoint(path: str) -> tuple[ModelConfig, dict, dict]:
    """(model config, model state dict, the run's data configuration) of checkpoint directory
    ``path`` (checkpoints from before the typed configuration: from their flags)."""
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path} is missing or corrupt ({e})") from None
    saved = meta.get("model_config")
    if not saved:
        raise CheckpointError(f"{meta_path} has no model_config")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise CheckpointError(f"{meta_path}: model_config fields {', '.join(unknown)} are unknown to this "
                              "version of autosp_lm")
    cfg = ModelConfig(**saved)
    if meta.get("format") == "torch_dist":
        from autosp_lm.models import build_model
        from autosp_lm.training import checkpoint_dist
        with torch.device("meta"):
            template = build_model(cfg).state_dict()
        try:
            state = checkpoint_dist.read_model_state(path, template)
        except checkpoint_dist.ShardedCheckpointError as e:
            raise CheckpointError(str(e)) from None
        return cfg, state, stored_config(meta).get("data", {})
    model_file = os.path.join(path, MODEL_FILE)
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)["model"]
    except FileNotFoundError:
        raise CheckpointError(f"{model_file} is missing") from None
    except Exception as e:  # noqa: BLE001 - truncated zip, pickle errors
        raise CheckpointError(f"{model_file} is unreadable ({type(e).__name__}: {e})") from None
    return cfg, state, stored_config(meta).get("data", {})


def run_tokenizer(data: dict):
    """The run's Hugging Face tokenizer file, None when it used another kind or none."""
    model = data.get("tokenizer_model")
    kind = data.get("tokenizer_type")
    if not model or kind != "HuggingFaceTokenizer":
        return None
    if not os.path.exists(model):
        print(f"note: the run's tokenizer {model} no longer exists; not exported (pass --tokenizer-model)",
              file=sys.stderr)
        return None
    return model


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        path = checkpoint_dir(args.load, args.iteration)
        cfg, state, run_data = read_checkpoint(path)
        tokenizer = args.tokenizer_model or run_tokenizer(run_data)
        if tokenizer is None and run_data.get("tokenizer_model"):
            print(f"note: tokenizer {run_data['tokenizer_model']} ({run_data.get('tokenizer_type')}) is not a "
                  "Hugging Face tokenizer: not exported", file=sys.stderr)
        if tokenizer is not None:
            from autosp_lm.data.tokenizer import HuggingFaceTokenizer
            tokenizer = HuggingFaceTokenizer(tokenizer)
        written = save_hf_checkpoint(state, cfg, args.output, dtype=DTYPES[args.dtype],
                                     max_shard_bytes=args.max_shard_size, tokenizer=tokenizer)
    except (CheckpointError, HFCheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {path} to {args.output}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
