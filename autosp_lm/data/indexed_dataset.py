"""Megatron-LM's indexed dataset format (``.bin`` + ``.idx``), read and written byte for byte.

A dataset is a pair of files sharing a prefix:

* ``PREFIX.bin``: every token of every sequence, back to back, in one numeric dtype;
* ``PREFIX.idx``: the index, all integers little-endian::

      offset  size        field
      0       9           magic  b"MMIDIDX\\x00\\x00"
      9       8           version, uint64, always 1
      17      1           dtype code, uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                          6 float64, 7 float32, 8 uint16)
      18      8           S = number of sequences, uint64
      26      8           C = number of entries in document_indices, uint64 (documents + 1)
      34      4 S         sequence lengths in tokens, int32
      34+4S   8 S         sequence pointers: byte offset of each sequence in .bin, int64
      34+12S  8 C         document indices: sequence index where each document starts, int64;
                          starts with 0 and ends with S
      34+12S+8C  S        (multimodal datasets only) sequence modes, int8

A document is a run of sequences (``document_indices[i]`` to ``document_indices[i+1]``); the
datasets we write hold one sequence per document, so ``document_indices`` is ``0, 1, ..., n``.
Token dtype is uint16 when the vocabulary has fewer than 65500 entries, int32 otherwise
(Megatron's rule), so files move freely between Megatron-LM and autosp_lm.

:class:`IndexedDataset` memory-maps a pair, checks that it is whole and consistent (a truncated
or mismatched pair is an :class:`IndexedDatasetError` naming the file, never garbage tokens) and
returns documents as numpy arrays. :class:`IndexedDatasetWriter` writes a pair atomically.
"""
from __future__ import annotations

import os
import struct
from array import array
from typing import Iterable, Optional, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}

_CHECK_CHUNK = 1 << 22  # sequences per chunk when verifying pointers (bounds memory)


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair that is missing, truncated, corrupt or inconsistent."""


def data_file_path(prefix: str) -> str:
    return str(prefix) + ".bin"


def index_file_path(prefix: str) -> str:
    return str(prefix) + ".idx"


def dtype_code(dtype) -> int:
    """Megatron's numeric code for a token dtype."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise ValueError(f"big-endian dtype {dt} cannot be stored")
    try:
        return _CODE_OF[dt.newbyteorder("=")]
    except KeyError:
        raise ValueError(f"dtype {dt} has no code in the indexed dataset format "
                         f"(supported: {sorted(str(d) for d in _CODE_OF)})") from None


def best_dtype(vocab_size: Optional[int]) -> np.dtype:
    """uint16 when the vocabulary fits (fewer than 65500 entries), int32 otherwise (Megatron)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def encode_index(sequence_lengths: Sequence[int], document_indices: Sequence[int], dtype,
                 sequence_modes: Optional[Sequence[int]] = None) -> bytes:
    """The bytes of a ``.idx`` file for the given sequences (pointers are derived from lengths)."""
    dt = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("sequence lengths must fit in int32")
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * dt.itemsize, out=pointers[1:])
    doc_idx = np.asarray(document_indices, dtype=np.int64)
    parts = [MAGIC, struct.pack("<Q", VERSION), struct.pack("<B", dtype_code(dt)),
             struct.pack("<Q", lengths.size), struct.pack("<Q", doc_idx.size),
             lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(),
             doc_idx.astype("<i8").tobytes()]
    if sequence_modes is not None:
        parts.append(np.asarray(sequence_modes, dtype=np.int8).tobytes())
    return b"".join(parts)


class IndexedDataset:
    """A memory-mapped Megatron indexed dataset: ``len(ds)`` documents, ``ds[i]`` a numpy array.

    Pickles as its prefix (the memory maps are reopened on the other side), so it can travel to
    DataLoader worker processes.
    """

    def __init__(self, prefix: str, *, verify: bool = True):
        self.prefix = str(prefix)
        self._verify = verify
        self._doc_lengths = None
        self._open()

    # -- opening and validation ------------------------------------------------------------
    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                hint = (" (give the prefix, without .bin/.idx)"
                        if self.prefix.endswith((".bin", ".idx")) else "")
                raise FileNotFoundError(f"indexed dataset file not found: {path} (prefix "
                                        f"{self.prefix!r} needs both .bin and .idx){hint}")
        idx_size = os.path.getsize(idx_path)
        if idx_size < HEADER_SIZE:
            raise IndexedDatasetError(f"{idx_path}: truncated index ({idx_size} bytes, the header "
                                      f"alone is {HEADER_SIZE})")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[:9] != MAGIC:
            raise IndexedDatasetError(f"{idx_path}: not a Megatron indexed dataset index (magic "
                                      f"{header[:9]!r}, expected {MAGIC!r})")
        version = struct.unpack_from("<Q", header, 9)[0]
        if version != VERSION:
            raise IndexedDatasetError(f"{idx_path}: unsupported index version {version} "
                                      f"(expected {VERSION})")
        code = header[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code} "
                                      f"(known: {sorted(DTYPE_CODES)})")
        self.dtype = DTYPE_CODES[code]
        n_seq = struct.unpack_from("<Q", header, 18)[0]
        n_doc_idx = struct.unpack_from("<Q", header, 26)[0]
        expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc_idx
        self.multimodal = idx_size == expected + n_seq and n_seq > 0
        if idx_size != expected and not self.multimodal:
            raise IndexedDatasetError(
                f"{idx_path}: index size {idx_size} bytes does not match its header "
                f"({n_seq} sequences, {n_doc_idx} document indices -> {expected} bytes); "
                f"the file is truncated or corrupt")
        if n_doc_idx < 1:
            raise IndexedDatasetError(f"{idx_path}: document index is empty (it must start with 0)")
        self._idx_mmap = np.memmap(idx_path, dtype=np.uint8, mode="r")
        buf = self._idx_mmap
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n_seq,
                                               offset=HEADER_SIZE + 4 * n_seq)
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=n_doc_idx,
                                              offset=HEADER_SIZE + 12 * n_seq)
        self.sequence_modes = (np.frombuffer(buf, dtype=np.int8, count=n_seq,
                                             offset=expected) if self.multimodal else None)
        if self.document_indices[0] != 0 or self.document_indices[-1] != n_seq:
            raise IndexedDatasetError(
                f"{idx_path}: document indices must run from 0 to the sequence count {n_seq}, "
                f"found {int(self.document_indices[0])} .. {int(self.document_indices[-1])}")
        itemsize = self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        want = (int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
                if n_seq else 0)
        if bin_size != want:
            raise IndexedDatasetError(
                f"{bin_path}: data file is {bin_size} bytes but its index {idx_path} describes "
                f"{want} bytes ({n_seq} sequences of {self.dtype}); the pair is truncated or "
                f"mismatched")
        if self._verify:
            self._verify_consistency(idx_path)
        self._bin_mmap = (np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size else
                          np.zeros(0, dtype=self.dtype))

    def _verify_consistency(self, idx_path: str) -> None:
        """Pointers follow from lengths, lengths are non-negative, documents never go backwards."""
        d = self.document_indices
        if d.size > 1 and np.any(d[1:] < d[:-1]):
            raise IndexedDatasetError(f"{idx_path}: document indices decrease (corrupt index)")
        itemsize = self.dtype.itemsize
        expect_ptr = 0
        n = self.sequence_lengths.size
        for start in range(0, n, _CHECK_CHUNK):
            lengths = self.sequence_lengths[start:start + _CHECK_CHUNK].astype(np.int64)
            if lengths.size and lengths.min() < 0:
                raise IndexedDatasetError(f"{idx_path}: negative sequence length (corrupt index)")
            ptrs = np.empty_like(lengths)
            ptrs[0] = expect_ptr
            np.cumsum(lengths[:-1] * itemsize, out=ptrs[1:])
            ptrs[1:] += expect_ptr
            if not np.array_equal(ptrs, self.sequence_pointers[start:start + _CHECK_CHUNK]):
                bad = start + int(np.argmax(ptrs != self.sequence_pointers[start:start + _CHECK_CHUNK]))
                raise IndexedDatasetError(
                    f"{idx_path}: sequence {bad} starts at byte {int(self.sequence_pointers[bad])} "
                    f"but the lengths before it put it at {int(ptrs[bad - start])} (corrupt index)")
            expect_ptr = int(ptrs[-1]) + int(lengths[-1]) * itemsize

    # -- pickling: reopen the memory maps in the receiving process ---------------------------
    def __getstate__(self):
        return {"prefix": self.prefix, "verify": False}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._verify = state["verify"]
        self._doc_lengths = None
        self._open()

    # -- access ------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self._bin_mmap.size)

    def __len__(self) -> int:
        return int(self.document_indices.size - 1)

    def _doc_span(self, i: int) -> tuple[int, int]:
        """(first token, token count) of document ``i`` in the .bin file."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range [0, {n}) in {self.prefix}")
        i %= n
        s0, s1 = int(self.document_indices[i]), int(self.document_indices[i + 1])
        if s1 == s0:
            return 0, 0
        start = int(self.sequence_pointers[s0]) // self.dtype.itemsize
        if s1 == s0 + 1:
            return start, int(self.sequence_lengths[s0])
        return start, int(self.sequence_lengths[s0:s1].sum(dtype=np.int64))

    def __getitem__(self, i) -> np.ndarray:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start, length = self._doc_span(int(i))
        return self._bin_mmap[start:start + length]

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """``length`` tokens of document ``i`` starting at token ``offset`` (to the end if None)."""
        start, n = self._doc_span(int(i))
        if offset < 0 or offset > n:
            raise IndexError(f"offset {offset} outside document {i} of length {n}")
        stop = n if length is None else min(n, offset + length)
        return self._bin_mmap[start + offset:start + stop]

    def document_lengths(self) -> np.ndarray:
        """Tokens per document, int64 (a document's sequences summed); computed once, read-only."""
        if self._doc_lengths is None:
            d = self.document_indices
            if d.size - 1 == self.sequence_lengths.size and np.array_equal(
                    d, np.arange(d.size, dtype=np.int64)):
                lengths = self.sequence_lengths.astype(np.int64)
            else:
                cum = np.zeros(self.sequence_lengths.size + 1, dtype=np.int64)
                np.cumsum(self.sequence_lengths, out=cum[1:])
                lengths = cum[d[1:]] - cum[d[:-1]]
            lengths.flags.writeable = False
            self._doc_lengths = lengths
        return self._doc_lengths

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {len(self)} documents, {self.num_tokens} "
                f"tokens, {self.dtype})")


class IndexedDatasetWriter:
    """Writes a ``.bin``/``.idx`` pair; the files appear (atomically renamed) on :meth:`finalize`.

    ``add_document(tokens)`` writes one document as one sequence; ``add_document(tokens,
    lengths=[...])`` writes one document made of several sequences. Use as a context manager:
    an exception leaves no partial files behind.
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # validate early
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_tmp = data_file_path(self.prefix) + tag
        self._idx_tmp = index_file_path(self.prefix) + tag
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = array("q")
        self._doc_idx = array("q", [0])
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self.num_tokens = 0
        self._done = False

    def add_document(self, tokens, lengths: Optional[Iterable[int]] = None) -> None:
        arr = np.asarray(tokens)
        if self._info is not None and arr.size and arr.dtype != self.dtype:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._info.min or hi > self._info.max:
                raise ValueError(f"token ids [{lo}, {hi}] do not fit in {self.dtype}")
        arr = np.ascontiguousarray(arr, dtype=self.dtype.newbyteorder("<"))
        if lengths is None:
            lengths = [arr.size]
        else:
            lengths = [int(x) for x in lengths]
            if sum(lengths) != arr.size:
                raise ValueError(f"sequence lengths {lengths} do not add up to {arr.size} tokens")
        self._bin.write(arr.tobytes())
        self._lengths.extend(lengths)
        self._doc_idx.append(len(self._lengths))
        self.num_tokens += arr.size

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def finalize(self) -> str:
        """Close the files and move them into place; returns the prefix."""
        self._bin.close()
        with open(self._idx_tmp, "wb") as f:
            f.write(encode_index(self._lengths, self._doc_idx, self.dtype))
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(self._idx_tmp, index_file_path(self.prefix))
        self._done = True
        return self.prefix

    def abort(self) -> None:
        if self._done:
            return
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and not self._done:
            self.finalize()
        else:
            self.abort()
        return None


__all__ = ["IndexedDataset", "IndexedDatasetWriter", "IndexedDatasetError", "DTYPE_CODES",
           "best_dtype", "dtype_code", "encode_index", "exists", "data_file_path",
           "index_file_path", "MAGIC", "HEADER_SIZE"]
