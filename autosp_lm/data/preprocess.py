"""Text -> token ids -> Megatron indexed datasets, tokenized in parallel worker processes.

``preprocess_files`` is what ``tools/preprocess_data.py`` runs: for each json key it writes
``{output_prefix}_{key}_document.bin/.idx`` (Megatron's naming). ``preprocess_texts`` does the
same for texts already in memory (the built-in corpus uses it).

The main process reads raw records and hands batches to a pool of worker processes that parse
JSON and tokenize; results come back in input order (so the output does not depend on the number
of workers) with a bounded number of batches in flight (so memory does not grow with the input).
A malformed jsonl line stops the run with ``file:line`` in the message, or with
``skip_bad_lines`` is counted and skipped. A document with no tokens is skipped and counted.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from .indexed_dataset import IndexedDatasetWriter, best_dtype
from .sources import BadLineError, Record, check_inputs, input_bytes, iter_records, parse_record
from .tokenizer import build_tokenizer

BATCH_CHARS = 1 << 20  # characters per batch sent to a worker
BATCH_RECORDS = 1024
MAX_BAD_EXAMPLES = 5


@dataclass
class PreprocessStats:
    outputs: dict = field(default_factory=dict)  # key -> output prefix
    documents: dict = field(default_factory=dict)  # key -> documents written
    empty_documents: dict = field(default_factory=dict)  # key -> empty documents skipped
    tokens: dict = field(default_factory=dict)  # key -> tokens written (eod included)
    bad_lines: int = 0
    bad_examples: list = field(default_factory=list)
    dtype: str = ""
    seconds: float = 0.0

    def summary(self) -> str:
        parts = []
        for k, prefix in self.outputs.items():
            parts.append(f"{prefix}: {self.documents[k]} documents, {self.tokens[k]} tokens "
                         f"({self.dtype}), {self.empty_documents[k]} empty documents skipped")
        if self.bad_lines:
            parts.append(f"{self.bad_lines} malformed lines skipped "
                         f"(first: {'; '.join(self.bad_examples[:2])})")
        parts.append(f"{self.seconds:.1f} s")
        return "\n".join(parts)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: ``{prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def default_workers() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n)


# --- worker side ---------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(tokenizer, keys: tuple, append_eod: bool, dtype: str) -> None:
    _WORKER.update(tok=tokenizer, keys=keys, append_eod=append_eod, dtype=np.dtype(dtype))


def _encode_batch(batch: list) -> list:
    """Parse and tokenize records: ``("ok", {key: ids})`` or ``("bad", path, line, reason)``."""
    tok, keys, eod, dt = _WORKER["tok"], _WORKER["keys"], _WORKER["append_eod"], _WORKER["dtype"]
    parsed, texts, out = [], [], []
    for rec in batch:
        try:
            docs = parse_record(rec, keys)
        except BadLineError as e:
            parsed.append(("bad", e.path, e.lineno, e.reason))
            continue
        parsed.append(("ok", len(texts)))
        texts.extend(docs[k] for k in keys)
    ids = tok.encode(texts) if texts else []
    eod_id = tok.eod_id
    for item in parsed:
        if item[0] == "bad":
            out.append(item)
            continue
        base = item[1]
        res = {}
        for j, k in enumerate(keys):
            seq = ids[base + j]
            if seq and eod:
                seq = seq + [eod_id]
            res[k] = np.asarray(seq, dtype=dt)
        out.append(("ok", res))
    return out


# --- main side -----------------------------------------------------------------------------
def _batches(records: Iterable[Record]) -> Iterator[list]:
    batch, chars = [], 0
    for rec in records:
        batch.append(rec)
        chars += rec.nbytes
        if chars >= BATCH_CHARS or len(batch) >= BATCH_RECORDS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _ordered_results(batches: Iterator[list], workers: int, init_args: tuple) -> Iterator[tuple]:
    """(batch, results) in input order, from ``workers`` processes, a few batches in flight."""
    if workers <= 1:
        _init_worker(*init_args)
        for b in batches:
            yield b, _encode_batch(b)
        return
    # spawn: safe in processes that already run threads (torch, gloo); workers import only numpy,
    # sentencepiece and this package. A worker that dies raises BrokenProcessPool (no hang).
    ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                             initializer=_init_worker, initargs=init_args)
    try:
        pending: deque = deque()
        try:
            for b in batches:
                pending.append((b, ex.submit(_encode_batch, b)))
                while len(pending) > 2 * workers:
                    b0, f0 = pending.popleft()
                    yield b0, f0.result()
            while pending:
                b0, f0 = pending.popleft()
                yield b0, f0.result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"a tokenizer worker process died ({e}); try --workers 1 to see "
                               f"the error in this process") from None
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _run(records: Iterable[Record], prefixes: dict, tokenizer, *, append_eod: bool,
         workers: int, skip_bad_lines: bool, progress: bool, total: Optional[int],
         desc: str) -> PreprocessStats:
    from tqdm import tqdm

    if append_eod and tokenizer.eod_id is None:
        raise ValueError(f"--append-eod needs an end-of-document id but {tokenizer.model_path} "
                         f"has no eos piece")
    t0 = time.time()
    keys = tuple(prefixes)
    dtype = best_dtype(tokenizer.vocab_size)
    stats = PreprocessStats(outputs=dict(prefixes), documents={k: 0 for k in keys},
                            empty_documents={k: 0 for k in keys}, tokens={k: 0 for k in keys},
                            dtype=str(dtype))
    writers = {k: IndexedDatasetWriter(p, dtype) for k, p in prefixes.items()}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress,
               mininterval=0.5, file=sys.stderr, dynamic_ncols=True)
    try:
        init = (tokenizer, keys, append_eod, dtype.str)
        with closing(_ordered_results(_batches(records), workers, init)) as results_iter:
            for batch, results in results_iter:
                for res in results:
                    if res[0] == "bad":
                        err = BadLineError(res[1], res[2], res[3])
                        if not skip_bad_lines:
                            raise err
                        stats.bad_lines += 1
                        if len(stats.bad_examples) < MAX_BAD_EXAMPLES:
                            stats.bad_examples.append(str(err))
                        continue
                    for k, arr in res[1].items():
                        if arr.size == 0:
                            stats.empty_documents[k] += 1
                            continue
                        writers[k].add_document(arr)
                        stats.documents[k] += 1
                        stats.tokens[k] += int(arr.size)
                bar.update(sum(r.nbytes for r in batch))
                bar.set_postfix(docs=stats.documents[keys[0]], refresh=False)
        for w in writers.values():
            w.finalize()
    finally:
        for w in writers.values():
            w.abort()  # no-op after finalize
        bar.close()
    stats.seconds = time.time() - t0
    return stats


def _as_tokenizer(tokenizer_model):
    """A tokenizer for a model path (SentencePiece ``.model``, or a Hugging Face ``tokenizer.json``
    / directory); any object with ``encode(list[str])``, ``vocab_size``, ``eod_id`` and
    ``model_path`` (picklable for workers) is used as is."""
    if isinstance(tokenizer_model, (str, os.PathLike)):
        return build_tokenizer(None, tokenizer_model)
    return tokenizer_model


def preprocess_files(inputs: Sequence[str], output_prefix: str,
                     tokenizer_model, *,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = False,
                     workers: int = 1, skip_bad_lines: bool = False, document_per: str = "file",
                     progress: bool = True) -> PreprocessStats:
    """Tokenize jsonl/text files into ``{output_prefix}_{key}_document.bin/.idx`` per json key."""
    inputs = check_inputs([os.fspath(p) for p in inputs])
    if not json_keys:
        raise ValueError("json_keys must name at least one key")
    tokenizer = _as_tokenizer(tokenizer_model)
    prefixes = {k: output_prefix_for(os.fspath(output_prefix), k) for k in json_keys}
    return _run(iter_records(inputs, document_per), prefixes, tokenizer, append_eod=append_eod,
                workers=workers, skip_bad_lines=skip_bad_lines, progress=progress,
                total=input_bytes(inputs), desc="tokenizing")


def preprocess_texts(texts: Iterable[Union[str, tuple]], output_prefix: str,
                     tokenizer_model, *, append_eod: bool = True,
                     workers: int = 1, progress: bool = True, total_chars: Optional[int] = None,
                     desc: str = "tokenizing") -> PreprocessStats:
    """Tokenize in-memory documents (``str`` or ``(name, str)``) into ``output_prefix.bin/.idx``."""
    def records():
        for i, t in enumerate(texts):
            name, text = t if isinstance(t, tuple) else (f"<document {i}>", t)
            yield Record(name, 1, "text", text)

    tokenizer = _as_tokenizer(tokenizer_model)
    return _run(records(), {"text": os.fspath(output_prefix)}, tokenizer, append_eod=append_eod,
                workers=workers, skip_bad_lines=False, progress=progress, total=total_chars,
                desc=desc)


__all__ = ["PreprocessStats", "preprocess_files", "preprocess_texts", "output_prefix_for",
           "default_workers"]
