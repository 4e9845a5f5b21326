"""GPT samples from indexed datasets: splits, epochs, shuffling, blending and their caches.

**Samples.** A split is a contiguous range of documents (``--split 969,30,1``, Megatron's
rounding). For each epoch ``e`` the split's documents are permuted (``rng(seed, e)``) and the
epochs are concatenated into one token stream. Sample ``i`` is the ``seq_length + 1`` tokens that
start at stream position ``i * seq_length`` (consecutive samples share one token, as in
Megatron), so samples run across document boundaries. Epochs are added until there are at least
``num_samples`` samples; the dataset length is every sample the full epochs hold.

Three arrays describe this, as in Megatron: ``doc_idx`` (the stream's documents), ``sample_idx``
(``[n + 1, 2]``: where sample ``i`` starts, as a ``doc_idx`` position and a token offset; sample
``i`` ends, inclusively, where sample ``i + 1`` starts) and ``shuffle_idx`` (the order in which
samples are served). Samples are shuffled within each epoch's block of samples, so the first
``k`` samples served are the same whatever ``num_samples`` is: a longer run, or a resumed one,
continues the exact order (samples are addressed by global index; the loader does the rest).

**Items.** ``ds[i]`` is ``input_ids = tokens[:-1]``, ``labels = tokens[1:]`` and
``position_ids``, int64 tensors of length ``seq_length``. With ``eod_mask_loss`` the label at
position ``t`` is ``-100`` when the *input* token at ``t`` is the end-of-document token (Megatron's
``loss_mask[tokens == eod] = 0``): the model is not trained to guess a new document's first token
across the boundary; predicting the end-of-document token itself is still trained. With
``reset_position_ids`` position ids restart at 0 on the token after each end-of-document token.
With ``reset_attention_mask`` the item also holds ``document_ids``: per token, the index of its
document within the sample (0, 1, ...; the end-of-document token belongs to the document it ends,
the next token starts the next one: the boundary of ``reset_position_ids``). Attention then stays
within each document (causal inside it): models and strategies build their masks from these ids,
and every rank of a sequence-parallel group receives them for the whole sample, like the tokens.

**Blends.** ``--data-path W1 P1 W2 P2 ...`` splits each prefix the same way and serves the
splits in proportion to the normalized weights: a deterministic interleaving where dataset ``j``'s
``k``-th sample has the key ``(k + 0.5) / w_j`` and samples are served in key order, so after any
``n`` samples each dataset has served ``w_j * n`` samples, give or take one.

**Caches.** The arrays are saved as ``.npy`` files under the cache directory (``--data-cache-path``,
else ``$AUTOSP_LM_CACHE``, else a ``cache`` directory next to the data prefix, else
``~/.cache/autosp_lm``), named by a hash of everything that determines them (format version,
prefix, the .bin/.idx sizes and mtimes, the split's document range, ``seq_length``, ``seed`` and
the number of epochs, which ``num_samples`` determines). One process builds them under a file lock
(``fcntl.flock``) writing temp files renamed into place, a ``-meta.json`` last; everyone then
memory-maps them (``np.load(mmap_mode="r")``). With ranks: rank 0 builds, all ranks meet at one
barrier, the others then find the files (or, without a shared file system, build their own).
"""
from __future__ import annotations

import math
import os
import sys
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .cache import (CACHE_VERSION, IndexCache, atomic_save_npy, atomic_write_text,  # noqa: F401
                    default_cache_dir, file_lock, user_cache_root)
from .indexed_dataset import IndexedDataset, data_file_path, index_file_path
from .indices import (build_blend_indices, build_document_index, build_sample_index,  # noqa: F401
                      build_shuffle_index, num_epochs_for, samples_in)

from .config import DEFAULT_SPLIT, DataConfig
SPLIT_NAMES = ("train", "valid", "test")


def log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


# --- flag parsing -------------------------------------------------------------------------------
def parse_data_path(data_path) -> list[tuple[float, str]]:
    """``[prefix]`` or ``[w1, p1, w2, p2, ...]`` -> ``[(weight, prefix), ...]`` with weights summing
    to 1; zero-weight entries are dropped."""
    if isinstance(data_path, (str, os.PathLike)):
        data_path = [os.fspath(data_path)]
    items = [os.fspath(x) for x in data_path]
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise ValueError(f"--data-path blend must be pairs `WEIGHT PREFIX ...`; got {len(items)} "
                         f"values: {items}")
    pairs = []
    for w, p in zip(items[::2], items[1::2]):
        try:
            wf = float(w)
        except ValueError:
            raise ValueError(f"--data-path weight {w!r} (before {p!r}) is not a number") from None
        if not math.isfinite(wf) or wf < 0:
            raise ValueError(f"--data-path weight {w!r} must be a non-negative number")
        pairs.append((wf, p))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError(f"--data-path weights {items[::2]} sum to zero")
    return [(w / total, p) for w, p in pairs if w > 0]


def parse_split(split: Optional[str]) -> list[float]:
    """``"969,30,1"`` (or ``/``-separated, up to three entries) -> three weights summing to 1."""
    if split is None:
        split = DEFAULT_SPLIT
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",") if x.strip() != ""]
    except ValueError:
        raise ValueError(f"--split {split!r} is not valid: give up to three non-negative "
                         f"proportions like 969,30,1") from None
    if not parts or len(parts) > 3 or any(x < 0 or not math.isfinite(x) for x in parts) \
            or sum(parts) <= 0:
        raise ValueError(f"--split {split!r} is not valid: give up to three non-negative "
                         f"proportions like 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [x / total for x in parts]


def split_ranges(num_documents: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Document ranges per split, Megatron's rule: round each share, then shift the boundaries
    so the last one is ``num_documents``."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [0] + [min(max(b - diff, 0), num_documents) for b in bounds[1:]]
    for i in range(1, len(bounds)):
        bounds[i] = max(bounds[i], bounds[i - 1])
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]


# --- datasets -----------------------------------------------------------------------------------
def _file_stamp(path: str) -> list:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


class _CachedIndexArrays:
    """Lazily memory-mapped index arrays of ``self.cache``; dropped when pickled (loader workers
    map them again)."""

    _arrays = None

    def _a(self) -> dict:
        if self._arrays is None:
            self._arrays = self.cache.load()
        return self._arrays

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_arrays"] = None
        return state


class GPTDataset(_CachedIndexArrays, torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from documents ``doc_range`` of an indexed dataset.

    ``prepare()`` builds the index cache if needed and ``load()`` memory-maps it (the module
    docstring describes both); ``ds[i]`` is the item dict. Picklable (arrays reopen lazily).
    """

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], *, seq_length: int,
                 num_samples: int, seed: int, cache_dir: str, name: str = "train",
                 eod_id: Optional[int] = None, eod_mask_loss: bool = False,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 vocab_size: Optional[int] = None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if (eod_mask_loss or reset_position_ids or reset_attention_mask) and eod_id is None:
            raise ValueError("--eod-mask-loss / --reset-position-ids / --reset-attention-mask "
                             "need an end-of-document id, but the tokenizer has none")
        self.indexed = indexed
        self.name = name
        self.doc_range = (int(doc_range[0]), int(doc_range[1]))
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.eod_id = eod_id
        self.eod_mask_loss = bool(eod_mask_loss)
        self.reset_position_ids = bool(reset_position_ids)
        self.reset_attention_mask = bool(reset_attention_mask)
        self.vocab_size = vocab_size
        lengths = indexed.document_lengths()[self.doc_range[0]:self.doc_range[1]]
        self.num_documents = int(lengths.size)
        self.tokens_per_epoch = int(lengths.sum())
        if self.tokens_per_epoch == 0:
            raise ValueError(f"{name} split of {indexed.prefix} (documents {self.doc_range[0]}.."
                             f"{self.doc_range[1]}) has no tokens")
        self.requested = int(num_samples)
        self.num_epochs = num_epochs_for(self.tokens_per_epoch, self.seq_length, self.requested)
        self.block_ends = [samples_in(e * self.tokens_per_epoch, self.seq_length)
                           for e in range(1, self.num_epochs + 1)]
        self.num_samples = self.block_ends[-1]
        prefix = indexed.prefix
        key = {"version": CACHE_VERSION, "kind": "gpt", "prefix": os.path.abspath(prefix),
               "idx": _file_stamp(index_file_path(prefix)),
               "bin": _file_stamp(data_file_path(prefix)),
               "documents": list(self.doc_range), "seq_length": self.seq_length,
               "seed": self.seed, "num_epochs": self.num_epochs}
        label = f"{os.path.basename(prefix)}-{name}"
        self.cache = IndexCache(cache_dir, label, key, ("doc_idx", "sample_idx", "shuffle_idx"),
                                self._build_indices)
        self._arrays = None

    def _build_indices(self) -> dict:
        lo, hi = self.doc_range
        all_lengths = self.indexed.document_lengths()
        doc_idx = build_document_index(np.arange(lo, hi, dtype=np.int64), self.num_epochs,
                                       self.seed)
        sample_idx = build_sample_index(all_lengths[doc_idx], self.seq_length, self.num_samples)
        shuffle_idx = build_shuffle_index(self.block_ends, self.seed)
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def prepare(self) -> bool:
        """Build the index cache unless present; returns whether it was built now."""
        return self.cache.ensure()

    def load(self) -> "GPTDataset":
        self._arrays = self.cache.load()
        return self

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, i: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``i`` (int64)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples}) in {self.name} "
                             f"split of {self.indexed.prefix}")
        a = self._a()
        j = int(a["shuffle_idx"][i])
        d0, o0 = (int(x) for x in a["sample_idx"][j])
        d1, o1 = (int(x) for x in a["sample_idx"][j + 1])
        doc_idx = a["doc_idx"]
        if d0 == d1:
            toks = self.indexed.get(int(doc_idx[d0]), o0, o1 - o0 + 1).astype(np.int64)
        else:
            parts = [self.indexed.get(int(doc_idx[d0]), o0)]
            parts += [self.indexed[int(doc_idx[d])] for d in range(d0 + 1, d1)]
            parts.append(self.indexed.get(int(doc_idx[d1]), 0, o1 + 1))
            toks = np.concatenate(parts).astype(np.int64)
        if toks.size != self.seq_length + 1:
            raise AssertionError(f"sample {i} has {toks.size} tokens, expected "
                                 f"{self.seq_length + 1} (corrupt cache {self.cache.stem}?)")
        if self.vocab_size is not None and toks.size and (toks.max() >= self.vocab_size
                                                          or toks.min() < 0):
            raise ValueError(f"{self.indexed.prefix}: token id {int(toks.max())} is outside the "
                             f"tokenizer's vocabulary of {self.vocab_size}; was the data made with "
                             f"another --tokenizer-model?")
        return toks

    def __getitem__(self, i: int) -> dict:
        return make_item(self.tokens(int(i)), self.eod_id, self.eod_mask_loss,
                         self.reset_position_ids, self.reset_attention_mask)

    def describe(self) -> str:
        return (f"{self.name}: {self.num_samples} samples from {self.num_documents} documents "
                f"({self.tokens_per_epoch} tokens/epoch, {self.num_epochs} epoch"
                f"{'s' if self.num_epochs != 1 else ''})")


def document_ids_of(inputs: np.ndarray, eod_id: int) -> np.ndarray:
    """Per token, the index of its document within the sample: a new document starts on the
    token after each end-of-document token."""
    ids = np.zeros(inputs.size, dtype=np.int64)
    if inputs.size > 1:
        ids[1:] = np.cumsum(inputs[:-1] == eod_id)
    return ids


def make_item(tokens: np.ndarray, eod_id: Optional[int], eod_mask_loss: bool,
              reset_position_ids: bool, reset_attention_mask: bool = False) -> dict:
    """The item dict of one sample's ``seq_length + 1`` tokens (module docstring: conventions)."""
    inputs = tokens[:-1]
    labels = tokens[1:].copy()
    n = inputs.size
    positions = np.arange(n, dtype=np.int64)
    item = {}
    if eod_id is not None and (eod_mask_loss or reset_position_ids or reset_attention_mask):
        is_eod = inputs == eod_id
        if eod_mask_loss:
            labels[is_eod] = -100
        if reset_position_ids:
            starts = np.zeros(n, dtype=np.int64)
            starts[1:] = np.where(is_eod[:-1], positions[1:], 0)
            positions = positions - np.maximum.accumulate(starts)
        if reset_attention_mask:
            item["document_ids"] = torch.from_numpy(document_ids_of(inputs, eod_id))
    return {"input_ids": torch.from_numpy(np.ascontiguousarray(inputs)),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions), **item}


class BlendedDataset(_CachedIndexArrays, torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (module docstring)."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float], size: int, *,
                 cache_dir: str, name: str = "train"):
        if len(datasets) != len(weights):
            raise ValueError("one weight per dataset")
        self.datasets = list(datasets)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        self.name = name
        key = {"version": CACHE_VERSION, "kind": "blend", "weights": self.weights,
               "size": self.size, "datasets": [d.cache.hash for d in self.datasets]}
        self.cache = IndexCache(cache_dir, f"blend-{name}", key,
                                ("dataset_index", "dataset_sample_index"), self._build)
        self._arrays = None

    def _build(self) -> dict:
        di, si = build_blend_indices(self.weights, self.size)
        counts = np.bincount(di, minlength=len(self.datasets))
        for j, d in enumerate(self.datasets):
            if counts[j] > len(d):
                raise AssertionError(f"blend needs {counts[j]} samples of {d.indexed.prefix}, "
                                     f"which has {len(d)}")
        return {"dataset_index": di, "dataset_sample_index": si}

    def prepare(self) -> bool:
        built = False
        for d in self.datasets:
            built |= d.prepare()
        return self.cache.ensure() or built

    def load(self) -> "BlendedDataset":
        for d in self.datasets:
            d.load()
        self._arrays = self.cache.load()
        return self

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range [0, {self.size}) in blended {self.name}")
        a = self._a()
        return self.datasets[int(a["dataset_index"][i])][int(a["dataset_sample_index"][i])]

    def describe(self) -> str:
        parts = ", ".join(f"{w:.3g} x {os.path.basename(d.indexed.prefix)}"
                          for w, d in zip(self.weights, self.datasets))
        return f"{self.name}: {self.size} samples blended from {parts}"


# --- building everything for a run --------------------------------------------------------------
def rank0_first(fn: Callable, rank: int = 0, barrier: Optional[Callable] = None):
    """Run the idempotent builder ``fn`` on rank 0, meet every rank at exactly one barrier, then
    run it on every rank (a no-op where rank 0's files are visible; built under the cache lock
    where they are not). A rank-0 failure is raised after the barrier, so no rank hangs. Returns
    rank 0's first result on rank 0, the second call's result elsewhere."""
    err = first = None
    if rank == 0:
        try:
            first = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised after the barrier
            err = e
    if barrier is not None:
        barrier()
    if err is not None:
        raise err
    again = fn()
    return first if rank == 0 else again


def prepare_on_ranks(datasets: Sequence, rank: int = 0, barrier: Optional[Callable] = None) -> None:
    """Build every dataset's cache rank-0-first (:func:`rank0_first`), then memory-map it."""
    datasets = [d for d in datasets if d is not None]
    rank0_first(lambda: [d.prepare() for d in datasets], rank, barrier)
    for d in datasets:
        d.load()


def build_split_datasets(blend: Sequence[tuple[float, str]], *, split: Optional[str],
                         num_samples: Sequence[int], seq_length: int, seed: int,
                         cache_dir: Optional[str], eod_id: Optional[int] = None,
                         eod_mask_loss: bool = False, reset_position_ids: bool = False,
                         reset_attention_mask: bool = False, vocab_size: Optional[int] = None, rank: int = 0,
                         barrier: Optional[Callable] = None) -> tuple[list, str]:
    """``[train, valid, test]`` (None where a split is empty) and a one-paragraph description."""
    weights = parse_split(split)
    indexed = [(w, IndexedDataset(p)) for w, p in blend]
    notes = []
    out: list = []
    for s, name in enumerate(SPLIT_NAMES):
        if weights[s] == 0:
            out.append(None)
            continue
        want = int(num_samples[s]) if s < len(num_samples) else 0
        parts = []
        for w, ds in indexed:
            lo, hi = split_ranges(len(ds), weights)[s]
            if hi > lo and ds.document_lengths()[lo:hi].sum() > 0:
                parts.append((w, ds, (lo, hi)))
        if not parts:
            msg = f"{name} split is empty (too few documents for --split {split})"
            if rank == 0:
                log(f"warning: {msg}; no {name} dataset")
            notes.append(msg)
            out.append(None)
            continue
        kw = dict(seq_length=seq_length, seed=seed, name=name, eod_id=eod_id,
                  eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                  reset_attention_mask=reset_attention_mask, vocab_size=vocab_size)
        if len(parts) == 1:
            w, ds, rng = parts[0]
            out.append(GPTDataset(ds, rng, num_samples=want,
                                  cache_dir=cache_dir or default_cache_dir(ds.prefix), **kw))
            continue
        total_w = sum(w for w, _, _ in parts)
        ws = [w / total_w for w, _, _ in parts]
        bcache = cache_dir or default_cache_dir(parts[0][1].prefix)
        size = want
        if size <= 0:  # one pass: as many samples as the datasets' single epochs allow
            single = [GPTDataset(ds, rng, num_samples=0, cache_dir=bcache, **kw)
                      for _, ds, rng in parts]
            size = max(1, min(int((len(d) - 2) / w) for d, w in zip(single, ws)))
        # dataset j serves at most w_j * (size + J / 2) + 0.5 of the first `size` samples
        half = len(parts) / 2
        comps = [GPTDataset(ds, rng, num_samples=int(math.floor(w * (size + half) + 0.5)) + 1,
                            cache_dir=cache_dir or default_cache_dir(ds.prefix), **kw)
                 for w, (_, ds, rng) in zip(ws, parts)]
        out.append(BlendedDataset(comps, ws, size, cache_dir=bcache, name=name))
    prepare_on_ranks(out, rank, barrier)
    desc = "; ".join(d.describe() for d in out if d is not None)
    if notes:
        desc += "; " + "; ".join(notes)
    return out, desc


def build_gpt_datasets(config: DataConfig, num_samples: Sequence[int], *, rank: int = 0,
                       barrier: Optional[Callable] = None):
    """``build_data``'s ``--data-path`` branch: a :class:`DataBundle` of GPT datasets."""
    from . import DataBundle
    from .tokenizer import build_tokenizer

    model = config.tokenizer_model
    if not model:
        raise ValueError("--data-path needs --tokenizer-model (the tokenizer the data was "
                         "tokenized with): the vocabulary size and end-of-document id come "
                         "from it")
    tok = build_tokenizer(config.tokenizer_type, model)
    blend = parse_data_path(list(config.data_path))
    split = config.split or DEFAULT_SPLIT
    datasets, desc = build_split_datasets(
        blend, split=split, num_samples=num_samples, seq_length=int(config.seq_length),
        seed=int(config.seed), cache_dir=config.data_cache_path, eod_id=tok.eod_id,
        eod_mask_loss=config.eod_mask_loss, reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        vocab_size=tok.vocab_size, rank=rank, barrier=barrier)
    names = ", ".join(f"{w:.3g} x {p}" for w, p in blend) if len(blend) > 1 else blend[0][1]
    return DataBundle(*datasets, vocab_size=tok.vocab_size, eod_id=tok.eod_id, tokenizer=tok,
                      description=f"indexed data {names} (split {split}, tokenizer "
                                  f"{os.path.basename(model)}, vocab {tok.vocab_size}): {desc}")


__all__ = ["GPTDataset", "BlendedDataset", "IndexCache", "build_gpt_datasets",
           "build_split_datasets", "build_blend_indices", "build_document_index",
           "build_sample_index", "build_shuffle_index", "parse_data_path", "parse_split",
           "split_ranges", "prepare_on_ranks", "make_item", "default_cache_dir", "file_lock",
           "user_cache_root"]
