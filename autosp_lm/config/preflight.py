"""Checks that need no model and no data, run by ``pretrain.py`` on the run's configuration right
after the flags' own (:func:`autosp_lm.config.build.build_run_config`) and before any set-up: what the flags name on disk
(the tokenizer, the data files, the ``--load`` checkpoint, a writable ``--save``) and what they
need of the machine (CUDA for ``--device cuda``, the wandb package). A mistake there is reported in the first second, not after the model is built, the
data indexed and the first step compiled.
"""
from __future__ import annotations

import importlib.util
import os

from ..training import checkpoint as ckpt
from ..training.checkpoint import CheckpointError
from .cli import ArgumentError
from .run_config import RunConfig

_TOKENIZER_FIX = ("give the tokenizer the data was made with (a SentencePiece .model from "
                  "tools/train_tokenizer.py, or a Hugging Face tokenizer.json)")


def check_paths(run: RunConfig) -> None:
    """The tokenizer (it is parsed: milliseconds), the data files, CUDA, W&B, a writable --save;
    raises :class:`ArgumentError` naming the flag and the fix."""
    data, save = run.data, run.training.checkpoint.save
    tok = data.tokenizer_model
    if tok and not os.path.exists(tok):
        raise ArgumentError(f"--tokenizer-model {tok}: no such file; {_TOKENIZER_FIX}")
    if tok and not data.mock_data:
        from ..data.tokenizer import build_tokenizer
        try:
            build_tokenizer(data.tokenizer_type, tok)
        except (OSError, ValueError) as e:
            raise ArgumentError(f"--tokenizer-model: {e}; {_TOKENIZER_FIX}") from None
    paths = data.data_path or ()
    for prefix in (paths[1::2] if len(paths) > 1 else paths):
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ArgumentError(f"--data-path {prefix}: {' and '.join(missing)} not found; give the "
                                "prefix tools/preprocess_data.py wrote (PREFIX.bin + PREFIX.idx, e.g. "
                                "data/corpus_text_document)")
    if run.parallel.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ArgumentError("--device cuda: CUDA is not available on this machine; use --device cpu "
                                "(or install the CUDA build of torch)")
    if run.training.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--wandb-project needs the wandb package: pip install wandb (or drop the flag)")
    if save:  # created now (the first save would create it), not after hours of training
        try:
            os.makedirs(save, exist_ok=True)
        except OSError as e:
            raise ArgumentError(f"--save {save}: cannot create it ({e.strerror}); choose a "
                                "directory you can write to") from None
        if not os.access(save, os.W_OK | os.X_OK):
            raise ArgumentError(f"--save {save}: not writable; choose a directory you can write to")


def check_resume(run: RunConfig) -> int:
    """The iteration ``--load`` resumes from (0: a fresh start). A missing, broken or differently
    shaped checkpoint is a :class:`CheckpointError` here; the vocabulary, which depends on the
    data, is compared when the weights are loaded."""
    saved = run.training.checkpoint
    if not saved.load:
        return 0
    path = ckpt.find_checkpoint(saved.load, auto_resume=saved.auto_resume)
    if path is None:
        if saved.auto_resume:
            return 0  # the auto-resume idiom: the trainer says that it starts fresh
        raise CheckpointError(f"--load {saved.load}: no checkpoint found (no '{ckpt.TRACKER}' tracker and "
                              "no iter_* directories); check the path, or drop --load to start fresh")
    meta = ckpt.read_metadata(path, run.model.config.to_dict(), ignore=("vocab_size",))
    return int(meta.get("iteration", 0))


__all__ = ["check_paths", "check_resume"]
