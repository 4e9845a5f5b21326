"""The built-in corpus (Python standard library sources): file list, full build, reuse, options."""
from __future__ import annotations

import os

import numpy as np

from autosp_lm.data import build_data
from autosp_lm.data.builtin_corpus import (build_builtin_datasets, builtin_cache_root,
                                           prepare_builtin_corpus, read_source, stdlib_root,
                                           stdlib_source_files)
from autosp_lm.data.indexed_dataset import IndexedDataset
from autosp_lm.data.tokenizer import Tokenizer
from tests.helpers.data import make_args, make_texts, train_tiny_tokenizer


def test_stdlib_file_list_is_sorted_and_deterministic():
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 100
    assert "os.py" in files and "json/__init__.py" in files
    assert not [f for f in files if set(f.split("/")[:-1]) & {"test", "tests", "site-packages"}]
    sub = stdlib_source_files(max_files=20)
    assert len(sub) == 20 and set(sub) <= set(files) and sub == stdlib_source_files(max_files=20)
    assert sub[0] == files[0]


def test_read_source_honours_encoding_cookie(tmp_path):
    p = tmp_path / "latin.py"
    p.write_bytes("# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n".encode("latin-1"))
    assert read_source(str(p)).endswith("name = 'café'\n")


def test_full_builtin_corpus_builds_once(tmp_path):
    """The default data source end to end: vocab 8000 tokenizer + every stdlib file, cached."""
    args = make_args(data_cache_path=str(tmp_path), seq_length=256)
    b = build_data(args, (200, 20, 5), mock_vocab_size=0)
    assert b.vocab_size == 8000 and b.eod_id == 2 and "built-in corpus" in b.description
    assert len(b.train) >= 200 and len(b.valid) >= 20 and len(b.test) >= 5
    files = stdlib_source_files()
    dirs = [d for d in os.listdir(os.path.join(tmp_path, "builtin")) if not d.endswith(".lock")]
    assert len(dirs) == 1
    prefix = os.path.join(tmp_path, "builtin", dirs[0], "stdlib_text_document")
    ds = IndexedDataset(prefix)
    with open(os.path.join(tmp_path, "builtin", dirs[0], "documents.txt")) as f:
        doc_files = f.read().splitlines()
    # each non-empty source file is one document
    assert doc_files == [f for f in files if os.path.getsize(os.path.join(stdlib_root(), f))]
    assert len(ds) == len(doc_files)
    tok = b.tokenizer
    for k in (0, doc_files.index("os.py"), len(doc_files) - 1):
        doc = ds[k]
        assert doc[-1] == tok.eod_id
        assert tok.decode(doc[:-1]) == read_source(os.path.join(stdlib_root(), doc_files[k]))
    x = b.train[0]
    assert x["input_ids"].shape == (256,) and int(x["input_ids"].max()) < 8000
    # later runs reuse everything: no file of the corpus is written again
    corpus_dir = os.path.join(tmp_path, "builtin", dirs[0])
    stamps = {f: os.stat(os.path.join(corpus_dir, f)).st_mtime_ns for f in os.listdir(corpus_dir)}
    again = build_data(args, (200, 20, 5), mock_vocab_size=0)
    assert {f: os.stat(os.path.join(corpus_dir, f)).st_mtime_ns
            for f in os.listdir(corpus_dir)} == stamps
    assert not again.train.cache.built
    assert np.array_equal(again.train.tokens(3), b.train.tokens(3))


def test_subset_env_cache_and_own_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSP_LM_CACHE", str(tmp_path / "env"))
    assert builtin_cache_root() == str(tmp_path / "env" / "builtin")
    calls = []
    b = build_builtin_datasets(make_args(seq_length=32, split="8,2,0"), (30, 5, 0), max_files=12,
                               vocab_size=600, progress=False, barrier=lambda: calls.append(1))
    assert len(calls) == 2  # one for the corpus, one for the sample indices
    assert b.vocab_size == 600 and b.test is None and b.train.cache.built
    assert b.train.cache.directory.startswith(str(tmp_path / "env" / "builtin"))
    c1 = prepare_builtin_corpus(vocab_size=600, max_files=12, progress=False)
    assert not c1.built
    # a user tokenizer instead of the trained one: a different corpus directory
    model = train_tiny_tokenizer(tmp_path, make_texts(50, seed=9), 200)
    c2 = prepare_builtin_corpus(tokenizer_model=model, max_files=12, progress=False)
    assert c2.built and c2.directory != c1.directory and c2.tokenizer_model == model
    assert Tokenizer(c2.tokenizer_model).vocab_size == 200
    assert int(max(IndexedDataset(c2.prefix)[i].max() for i in range(12))) < 200
