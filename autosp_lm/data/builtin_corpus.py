"""The built-in corpus: the Python standard library's own ``.py`` sources, on every machine.

With neither ``--data-path`` nor ``--mock-data``, pretraining uses it. On first use it

1. lists the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (sorted relative paths,
   skipping ``site-packages``/``dist-packages``, test directories and ``__pycache__``);
2. trains a SentencePiece BPE tokenizer (vocab 8000, byte fallback, lossless for code) on a
   deterministic sample of their lines, unless ``--tokenizer-model`` names one to use instead;
3. tokenizes each (non-empty) file as one document ending with the end-of-document token into a
   Megatron indexed dataset (``documents.txt`` lists the files in document order) (the same functions ``tools/train_tokenizer.py`` and
   ``tools/preprocess_data.py`` run);

all in a cache directory (``--data-cache-path``, else ``$AUTOSP_LM_CACHE``, else
``~/.cache/autosp_lm``, then ``builtin/stdlib-py<X.Y>-v<vocab>-<hash>``) whose name hashes the
Python version, the file list (paths and sizes), the vocabulary size and the tokenizer; later runs
reuse it. Rank 0 builds while the other ranks wait at a barrier, and a file lock keeps independent
processes from building it twice. Splits, samples and their caches then follow the ``--data-path``
path (:mod:`autosp_lm.data.gpt_dataset`).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import sysconfig
import time
import tokenize
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .gpt_dataset import (DEFAULT_SPLIT, atomic_write_text, build_split_datasets, file_lock, log,
                          rank0_first, user_cache_root)

BUILTIN_VOCAB_SIZE = 8000
MAX_TOKENIZER_SENTENCES = 300_000
FORMAT_VERSION = 1
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                       "__pycache__"})


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_source_files(root: Optional[str] = None, max_files: Optional[int] = None) -> list[str]:
    """Sorted relative (``/``-separated) paths of the stdlib's ``.py`` files.

    ``max_files`` keeps an evenly spaced deterministic subset (for fast tests).
    """
    root = root or stdlib_root()
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        rel = os.path.relpath(d, root)
        for n in names:
            if n.endswith(".py"):
                files.append(n if rel == "." else os.path.join(rel, n).replace(os.sep, "/"))
    files.sort()
    if max_files is not None and 0 < max_files < len(files):
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    return files


def read_source(path: str) -> str:
    """A Python file's text, honouring its encoding declaration (PEP 263)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError):
        return raw.decode("utf-8", errors="replace")


def builtin_cache_root(data_cache_path: Optional[str] = None) -> str:
    """``<--data-cache-path | $AUTOSP_LM_CACHE | ~/.cache/autosp_lm>/builtin``."""
    base = os.path.abspath(os.path.expanduser(data_cache_path)) if data_cache_path \
        else user_cache_root()
    return os.path.join(base, "builtin")


@dataclass
class BuiltinCorpus:
    directory: str
    prefix: str  # the indexed dataset prefix
    tokenizer_model: str
    num_files: int
    built: bool  # this call built it


def _sha_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _corpus_key(root: str, files: Sequence[str], vocab_size: int,
                tokenizer_model: Optional[str]) -> tuple[dict, str]:
    listing = hashlib.sha256()
    for rel in files:
        listing.update(f"{rel}\0{os.path.getsize(os.path.join(root, rel))}\n".encode())
    key = {"version": FORMAT_VERSION, "python": list(sys.version_info[:3]),
           "implementation": sys.implementation.name, "files": len(files),
           "file_list_sha256": listing.hexdigest(), "vocab_size": int(vocab_size),
           "tokenizer": _sha_file(tokenizer_model) if tokenizer_model else "trained"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = (f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-"
            f"{'v%d' % vocab_size if not tokenizer_model else 'tok'}-{digest}")
    return key, name


def _build_corpus(directory: str, root: str, files: Sequence[str], vocab_size: int,
                  tokenizer_model: Optional[str], workers: int, progress: bool,
                  key: dict) -> None:
    from .preprocess import preprocess_texts
    from .tokenizer import train_sentencepiece, training_sentences

    t0 = time.time()
    os.makedirs(directory, exist_ok=True)
    log(f"building the built-in corpus from {len(files)} Python standard library files in "
         f"{directory} (once; later runs reuse it)")
    texts = [read_source(os.path.join(root, rel)) for rel in files]
    # empty files (some __init__.py) make no document; documents.txt maps documents to files
    kept = [(rel, t) for rel, t in zip(files, texts) if t]
    atomic_write_text(os.path.join(directory, "documents.txt"), "".join(f"{r}\n" for r, _ in kept))
    if tokenizer_model is None:
        log(f"training a {vocab_size}-piece SentencePiece BPE tokenizer")
        model = train_sentencepiece(training_sentences(texts), os.path.join(directory, "tokenizer"),
                                    vocab_size, model_type="bpe", byte_fallback=True,
                                    character_coverage=0.9999,
                                    max_sentences=MAX_TOKENIZER_SENTENCES)
    else:
        model = tokenizer_model
    t1 = time.time()
    stats = preprocess_texts(kept, os.path.join(directory, "stdlib_text_document"),
                             model, append_eod=True, workers=workers, progress=progress,
                             total_chars=sum(len(t) for t in texts),
                             desc="tokenizing the built-in corpus")
    manifest = dict(key, tokenizer_model=model, documents=stats.documents["text"],
                    tokens=stats.tokens["text"], empty_documents=stats.empty_documents["text"],
                    tokenizer_seconds=round(t1 - t0, 2), total_seconds=round(time.time() - t0, 2))
    atomic_write_text(os.path.join(directory, "manifest.json"),
                      json.dumps(manifest, indent=1, sort_keys=True))
    log(f"built-in corpus ready: {manifest['documents']} documents, {manifest['tokens']} tokens, "
         f"{manifest['total_seconds']} s")


def prepare_builtin_corpus(cache_root: Optional[str] = None, *,
                           vocab_size: int = BUILTIN_VOCAB_SIZE,
                           tokenizer_model: Optional[str] = None, max_files: Optional[int] = None,
                           workers: Optional[int] = None, progress: bool = True, rank: int = 0,
                           barrier: Optional[Callable] = None,
                           root: Optional[str] = None) -> BuiltinCorpus:
    """Build (once) or find the built-in corpus; every rank calls it and meets one barrier."""
    root = root or stdlib_root()
    cache_root = cache_root or builtin_cache_root()
    files = stdlib_source_files(root, max_files)
    if not files:
        raise FileNotFoundError(f"no Python standard library sources under {root}; pass "
                                f"--data-path or --mock-data")
    if tokenizer_model is not None:
        tokenizer_model = os.path.abspath(tokenizer_model)
    key, name = _corpus_key(root, files, vocab_size, tokenizer_model)
    directory = os.path.join(cache_root, name)
    manifest = os.path.join(directory, "manifest.json")
    if workers is None:
        # in-process tokenization of ~12 MB takes seconds; worker start-up would cost as much
        workers = 1

    def ensure() -> bool:
        if os.path.isfile(manifest):
            return False
        try:
            os.makedirs(cache_root, exist_ok=True)
        except OSError as e:
            raise PermissionError(f"cannot create the data cache {cache_root} ({e}); choose "
                                  f"another with --data-cache-path or $AUTOSP_LM_CACHE") from None
        with file_lock(directory + ".lock"):
            if os.path.isfile(manifest):
                return False
            _build_corpus(directory, root, files, vocab_size, tokenizer_model, workers,
                          progress, key)
            return True

    built = bool(rank0_first(ensure, rank, barrier))
    with open(manifest) as f:
        info = json.load(f)
    return BuiltinCorpus(directory=directory, prefix=os.path.join(directory, "stdlib_text_document"),
                         tokenizer_model=info["tokenizer_model"], num_files=len(files), built=built)


def build_builtin_datasets(config, num_samples: Sequence[int], *, rank: int = 0,
                           barrier: Optional[Callable] = None, max_files: Optional[int] = None,
                           vocab_size: int = BUILTIN_VOCAB_SIZE, progress: bool = True):
    """``build_data``'s default branch: a :class:`DataBundle` over the built-in corpus.

    ``config``: a :class:`~autosp_lm.data.config.DataConfig`. ``max_files``/``vocab_size`` make
    a smaller corpus (tests). Calls ``barrier`` exactly twice.
    """
    from . import DataBundle
    from .tokenizer import build_tokenizer

    corpus = prepare_builtin_corpus(builtin_cache_root(config.data_cache_path),
                                    vocab_size=vocab_size, tokenizer_model=config.tokenizer_model,
                                    max_files=max_files, progress=progress, rank=rank,
                                    barrier=barrier)
    tok = build_tokenizer(config.tokenizer_type if config.tokenizer_model else None,
                          corpus.tokenizer_model)
    split = config.split or DEFAULT_SPLIT
    datasets, desc = build_split_datasets(
        [(1.0, corpus.prefix)], split=split, num_samples=num_samples,
        seq_length=int(config.seq_length), seed=int(config.seed),
        cache_dir=os.path.join(corpus.directory, "index"), eod_id=tok.eod_id,
        eod_mask_loss=config.eod_mask_loss, reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        vocab_size=tok.vocab_size, rank=rank, barrier=barrier)
    return DataBundle(*datasets, vocab_size=tok.vocab_size, eod_id=tok.eod_id, tokenizer=tok,
                      description=f"built-in corpus: {corpus.num_files} Python {sys.version_info[0]}."
                                  f"{sys.version_info[1]} standard library files ({corpus.directory}, "
                                  f"split {split}, vocab {tok.vocab_size}): {desc}")


__all__ = ["BuiltinCorpus", "prepare_builtin_corpus", "build_builtin_datasets",
           "stdlib_source_files", "builtin_cache_root", "read_source", "BUILTIN_VOCAB_SIZE"]
