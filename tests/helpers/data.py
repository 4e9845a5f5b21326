"""Helpers shared by the data tests (no tests here): generated text, tiny tokenizers, an
independent Megatron .bin/.idx reader written from the format spec."""
from __future__ import annotations

import json
import os
import random
import struct
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "zé", "qu", "th", "er", "an", "ou"]


def make_texts(n_docs: int, seed: int = 0, max_lines: int = 4) -> list[str]:
    """Deterministic pseudo-text documents with spaces, newlines, indentation and punctuation."""
    r = random.Random(seed)

    def word():
        return "".join(r.choice(_SYLLABLES) for _ in range(r.randint(1, 3)))

    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(r.randint(1, max_lines)):
            indent = "    " * r.randint(0, 2)
            lines.append(indent + " ".join(word() for _ in range(r.randint(2, 10)))
                         + r.choice(["", ".", ",", ":", " (x)"]))
        docs.append("\n".join(lines))
    return docs


def write_jsonl(path, texts, key="text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


def train_tiny_tokenizer(directory, texts, vocab_size: int = 256, name: str = "tok") -> str:
    from autosp_lm.data.tokenizer import train_sentencepiece, training_sentences

    return train_sentencepiece(training_sentences(texts), os.path.join(str(directory), name),
                               vocab_size, num_threads=1)


def read_megatron(prefix: str):
    """Read a Megatron indexed dataset with nothing but numpy and explicit offsets (the spec)."""
    dtypes = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
              7: np.float32, 8: np.uint16}
    idx = open(prefix + ".idx", "rb").read()
    assert idx[0:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", idx[9:17])[0] == 1
    dtype = np.dtype(dtypes[idx[17]])
    n_seq = struct.unpack("<Q", idx[18:26])[0]
    n_doc = struct.unpack("<Q", idx[26:34])[0]
    off = 34
    lengths = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
    off += 4 * n_seq
    pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off)
    off += 8 * n_seq
    doc_idx = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=off)
    off += 8 * n_doc
    assert off == len(idx)
    data = open(prefix + ".bin", "rb").read()
    seqs = [np.frombuffer(data, dtype=dtype.newbyteorder("<"), count=int(n), offset=int(p))
            for n, p in zip(lengths, pointers)]
    docs = [np.concatenate(seqs[doc_idx[i]:doc_idx[i + 1]]) if doc_idx[i + 1] > doc_idx[i]
            else np.zeros(0, dtype) for i in range(n_doc - 1)]
    return {"dtype": dtype, "code": idx[17], "lengths": lengths, "pointers": pointers,
            "doc_idx": doc_idx, "docs": docs}


EOD = 2  # SentencePiece eos of the tiny tokenizers


def random_docs(n, seed, lo=10, hi=200, max_len=20):
    """``n`` random token documents, each ending in :data:`EOD`."""
    r = np.random.default_rng(seed)
    return [list(r.integers(lo, hi, r.integers(1, max_len))) + [EOD] for _ in range(n)]


def write_docs(prefix, docs, dtype=np.uint16) -> str:
    from autosp_lm.data.indexed_dataset import IndexedDatasetWriter

    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d))
    return str(prefix)


def make_args(**kw):
    """A data configuration (no argparse): 16-token samples unless told otherwise."""
    from autosp_lm.data import DataConfig
    return DataConfig(**{"seq_length": 16, **kw})


def run_tool(name: str, *argv, check: bool = True):
    import subprocess

    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", name), *map(str, argv)],
                          capture_output=True, text=True, cwd="/", timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def tool_main(name: str, *argv) -> int:
    """Run a tool's ``main(argv)`` in this process (faster than a subprocess)."""
    import importlib.util

    path = os.path.join(REPO, "tools", name)
    spec = importlib.util.spec_from_file_location(f"_tool_{name[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main([str(a) for a in argv])
