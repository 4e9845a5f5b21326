"""Caches under concurrency: ranks behind a barrier, and independent processes racing."""
from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np

from autosp_lm.data.builtin_corpus import build_builtin_datasets, prepare_builtin_corpus
from autosp_lm.data.gpt_dataset import build_gpt_datasets
from tests.helpers.data import (make_args, make_texts, random_docs, train_tiny_tokenizer,
                                write_docs)
from tests.helpers.dist import run_distributed

SUBSET = dict(max_files=10, vocab_size=600, progress=False)


def _setup(tmp_path):
    model = train_tiny_tokenizer(tmp_path, make_texts(80, seed=5), 256)
    prefix = write_docs(tmp_path / "d", random_docs(200, seed=7))
    gpt_args = make_args(data_path=[prefix], tokenizer_model=model, split="9,1,0", seq_length=8,
                         data_cache_path=str(tmp_path / "c"))
    builtin_args = make_args(seq_length=16, split="1", data_cache_path=str(tmp_path / "b"))
    return gpt_args, builtin_args


def _rank_build(rank, world_size, gpt_args, builtin_args):
    import torch.distributed as dist

    calls = []

    def barrier():
        calls.append(1)
        dist.barrier()

    b = build_gpt_datasets(gpt_args, (40, 4, 0), rank=rank, barrier=barrier)
    corpus = prepare_builtin_corpus(os.path.join(builtin_args.data_cache_path, "builtin"),
                                    rank=rank, barrier=barrier, **SUBSET)
    c = build_builtin_datasets(builtin_args, (20, 0, 0), rank=rank, barrier=barrier, **SUBSET)
    return {"gpt_built": b.train.cache.built or b.valid.cache.built,
            "corpus_built": corpus.built, "index_built": c.train.cache.built,
            "barriers": len(calls), "gpt": [b.train.tokens(i).tolist() for i in range(5)],
            "builtin": [c.train.tokens(i).tolist() for i in range(5)]}


def test_ranks_build_once_behind_barriers(tmp_path):
    """Rank 0 builds, rank 1 waits at the barrier then memory-maps; same barrier count."""
    gpt_args, builtin_args = _setup(tmp_path)
    r0, r1 = run_distributed(_rank_build, 2, gpt_args, builtin_args, timeout=180)
    for key in ("gpt_built", "corpus_built", "index_built"):
        assert (r0[key], r1[key]) == (True, False), key
    assert r0["barriers"] == r1["barriers"] == 4  # 1 (--data-path) + 1 (corpus) + 2 (built-in)
    assert r0["gpt"] == r1["gpt"] and r0["builtin"] == r1["builtin"]


def _process_build(gpt_args, builtin_args, queue):
    import torch

    torch.set_num_threads(1)
    try:
        b = build_gpt_datasets(gpt_args, (300, 0, 0))
        corpus = prepare_builtin_corpus(os.path.join(builtin_args.data_cache_path, "builtin"),
                                        **SUBSET)
        queue.put((b.train.cache.built, corpus.built, b.train.tokens(0).tolist(),
                   open(corpus.prefix + ".bin", "rb").read()))
    except BaseException as e:  # noqa: BLE001
        queue.put(repr(e))


def test_independent_processes_do_not_race(tmp_path):
    """No barrier: the file locks make exactly one process build each cache."""
    gpt_args, builtin_args = _setup(tmp_path)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_process_build, args=(gpt_args, builtin_args, q))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(isinstance(r, tuple) for r in results), results
    assert sorted(r[0] for r in results) == [False, True]
    assert sorted(r[1] for r in results) == [False, True]
    assert results[0][2] == results[1][2] and results[0][3] == results[1][3]
    leftovers = [f for d, _, fs in os.walk(tmp_path) for f in fs if ".tmp-" in f]
    assert not leftovers
    assert np.frombuffer(results[0][3], dtype=np.uint16).size > 1000
