"""Megatron indexed dataset format: exact bytes, independent reader, validation errors."""
from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from autosp_lm.data.indexed_dataset import (IndexedDataset, IndexedDatasetError,
                                            IndexedDatasetWriter, best_dtype, dtype_code,
                                            encode_index)
from autosp_lm.data.preprocess import preprocess_texts
from tests.helpers.data import make_texts, read_megatron, train_tiny_tokenizer, write_docs

DOCS = [[1, 2, 3], [7], [65499, 0]]


def expected_idx(code: int, lengths, itemsize: int) -> bytes:
    """The .idx bytes of one-sequence-per-document data, built by hand from the spec."""
    n = len(lengths)
    out = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([code])
    out += n.to_bytes(8, "little") + (n + 1).to_bytes(8, "little")
    for L in lengths:
        out += L.to_bytes(4, "little", signed=True)
    ptr = 0
    for L in lengths:
        out += ptr.to_bytes(8, "little", signed=True)
        ptr += L * itemsize
    for i in range(n + 1):
        out += i.to_bytes(8, "little", signed=True)
    return out


@pytest.mark.parametrize("dtype,code,fmt", [(np.uint16, 8, "<H"), (np.int32, 4, "<i")])
def test_bytes_on_disk_match_hand_computed(tmp_path, dtype, code, fmt):
    prefix = write_docs(tmp_path / "d", DOCS, dtype)
    idx = (tmp_path / "d.idx").read_bytes()
    assert idx[17] == code
    itemsize = np.dtype(dtype).itemsize
    assert idx == expected_idx(code, [3, 1, 2], itemsize)
    flat = [t for d in DOCS for t in d]
    assert (tmp_path / "d.bin").read_bytes() == b"".join(struct.pack(fmt, t) for t in flat)
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == np.dtype(dtype)
    assert [ds[i].tolist() for i in range(3)] == DOCS
    assert ds.document_lengths().tolist() == [3, 1, 2]
    assert ds.get(0, 1, 1).tolist() == [2] and ds[-1].tolist() == DOCS[-1]


def test_dtype_rule_and_codes():
    assert best_dtype(8000) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(None) == np.int32
    assert [dtype_code(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64,
                                    np.float32, np.uint16)] == [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError):
        dtype_code(np.uint32)


class _BigVocab:
    """A stand-in tokenizer with a vocabulary too big for uint16 (forces int32 files)."""
    vocab_size, eod_id, model_path = 70000, 69999, "<big>"

    def encode(self, texts):
        return [[60000 + ord(c) for c in t] for t in texts]


def test_preprocess_picks_int32_for_big_vocab(tmp_path):
    stats = preprocess_texts(["abc", "", "de"], str(tmp_path / "big"), _BigVocab(), progress=False)
    assert stats.dtype == "int32" and stats.documents["text"] == 2
    assert stats.empty_documents["text"] == 1
    meg = read_megatron(str(tmp_path / "big"))
    assert meg["code"] == 4
    assert [d.tolist() for d in meg["docs"]] == [[60097, 60098, 60099, 69999], [60100, 60101, 69999]]
    assert [d.tolist() for d in IndexedDataset(str(tmp_path / "big"))] == \
        [d.tolist() for d in meg["docs"]]


def test_independent_reader_agrees_on_real_tokenizer_output(tmp_path):
    texts = make_texts(60, seed=3)
    model = train_tiny_tokenizer(tmp_path, texts, 220)
    preprocess_texts(texts, str(tmp_path / "x"), model, append_eod=True, progress=False)
    meg = read_megatron(str(tmp_path / "x"))
    ds = IndexedDataset(str(tmp_path / "x"))
    assert meg["code"] == 8 and len(ds) == len(meg["docs"]) == 60
    assert meg["doc_idx"].tolist() == list(range(61))
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i], meg["docs"][i])
    np.testing.assert_array_equal(ds.sequence_pointers, meg["pointers"])


def test_multi_sequence_documents(tmp_path):
    # Megatron data made with sentence splitting: several sequences per document
    with IndexedDatasetWriter(str(tmp_path / "m"), np.uint16) as w:
        w.add_document([1, 2, 3, 4], lengths=[1, 3])
        w.add_document([5], lengths=[1])
        w.add_document([6, 7, 8], lengths=[2, 1])
    meg = read_megatron(str(tmp_path / "m"))
    assert meg["doc_idx"].tolist() == [0, 2, 3, 5] and meg["lengths"].tolist() == [1, 3, 1, 2, 1]
    ds = IndexedDataset(str(tmp_path / "m"))
    assert len(ds) == 3 and ds.num_sequences == 5
    assert [ds[i].tolist() for i in range(3)] == [[1, 2, 3, 4], [5], [6, 7, 8]]
    assert ds.document_lengths().tolist() == [4, 1, 3]


def test_pickle_and_writer_abort(tmp_path):
    prefix = write_docs(tmp_path / "p", DOCS)
    ds = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert ds[2].tolist() == DOCS[2]
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "gone"), np.uint16) as w:
            w.add_document([1, 2])
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["p.bin", "p.idx"]
    with pytest.raises(ValueError, match="do not fit"):
        IndexedDatasetWriter(str(tmp_path / "q"), np.uint16).add_document([70000])


# --- bad files ------------------------------------------------------------------------------
def test_missing_file_names_it(tmp_path):
    prefix = write_docs(tmp_path / "a", DOCS)
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match="a.bin"):
        IndexedDataset(prefix)


def test_truncated_bin(tmp_path):
    prefix = write_docs(tmp_path / "a", DOCS)
    data = (tmp_path / "a.bin").read_bytes()
    (tmp_path / "a.bin").write_bytes(data[:-2])
    with pytest.raises(IndexedDatasetError, match=r"a\.bin.*10 bytes.*12 bytes"):
        IndexedDataset(prefix)


def test_truncated_idx(tmp_path):
    prefix = write_docs(tmp_path / "a", DOCS)
    idx = (tmp_path / "a.idx").read_bytes()
    (tmp_path / "a.idx").write_bytes(idx[:-8])
    with pytest.raises(IndexedDatasetError, match=r"a\.idx.*truncated"):
        IndexedDataset(prefix)
    (tmp_path / "a.idx").write_bytes(idx[:20])
    with pytest.raises(IndexedDatasetError, match=r"a\.idx.*truncated"):
        IndexedDataset(prefix)


def test_mismatched_pair(tmp_path):
    write_docs(tmp_path / "a", DOCS)
    write_docs(tmp_path / "b", [[1, 2], [3, 4, 5, 6, 7]])
    os.replace(tmp_path / "b.idx", tmp_path / "a.idx")  # a.bin has 6 tokens, this idx says 7
    with pytest.raises(IndexedDatasetError, match=r"a\.bin.*mismatched"):
        IndexedDataset(str(tmp_path / "a"))


@pytest.mark.parametrize("offset,value,match", [
    (0, b"XXIDIDX\x00\x00", "magic"),
    (9, (2).to_bytes(8, "little"), "version 2"),
    (17, bytes([9]), "dtype code 9"),
])
def test_bad_header_fields(tmp_path, offset, value, match):
    prefix = write_docs(tmp_path / "a", DOCS)
    idx = bytearray((tmp_path / "a.idx").read_bytes())
    idx[offset:offset + len(value)] = value
    (tmp_path / "a.idx").write_bytes(bytes(idx))
    with pytest.raises(IndexedDatasetError, match=match):
        IndexedDataset(prefix)


def test_inconsistent_pointers_and_doc_indices(tmp_path):
    prefix = write_docs(tmp_path / "a", DOCS)
    good = encode_index([3, 1, 2], [0, 1, 2, 3], np.uint16)
    bad = bytearray(good)
    struct.pack_into("<q", bad, 34 + 12 + 8, 4)  # second pointer 6 -> 4
    (tmp_path / "a.idx").write_bytes(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="sequence 1 starts at byte 4"):
        IndexedDataset(prefix)
    (tmp_path / "a.idx").write_bytes(encode_index([3, 1, 2], [0, 2, 1, 3], np.uint16))
    with pytest.raises(IndexedDatasetError, match="decrease"):
        IndexedDataset(prefix)
    (tmp_path / "a.idx").write_bytes(encode_index([3, 1, 2], [1, 2, 3], np.uint16))
    with pytest.raises(IndexedDatasetError, match="from 0"):
        IndexedDataset(prefix)
