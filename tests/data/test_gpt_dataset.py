"""GPT samples: construction, eod conventions, splits, caches, blending, loader, ranks."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from autosp_lm.data import build_data, build_loader
from autosp_lm.data.gpt_dataset import (BlendedDataset, GPTDataset, build_blend_indices,
                                        build_gpt_datasets, make_item, parse_data_path,
                                        parse_split, split_ranges)
from autosp_lm.data.indexed_dataset import IndexedDataset
from tests.helpers.data import (EOD, make_args, make_texts, random_docs, train_tiny_tokenizer,
                                write_docs)



@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"), make_texts(80, seed=5), 256)


def stream_of(ds: GPTDataset) -> np.ndarray:
    a = ds._a()
    return np.concatenate([ds.indexed[int(d)] for d in a["doc_idx"]]).astype(np.int64)


def test_samples_run_across_documents_like_megatron(tmp_path):
    docs = random_docs(30, seed=0)
    ds = GPTDataset(IndexedDataset(write_docs(tmp_path / "d", docs)), (0, 30), seq_length=7,
                    num_samples=200, seed=3, cache_dir=str(tmp_path / "c"))
    assert ds.prepare() and not ds.prepare()
    ds.load()
    T = sum(len(d) for d in docs)
    assert ds.tokens_per_epoch == T and ds.num_epochs == -(-(200 * 7 + 1) // T)
    assert len(ds) == (ds.num_epochs * T - 1) // 7 >= 200
    a = ds._a()
    for e in range(ds.num_epochs):  # each epoch is a permutation of the documents
        assert sorted(a["doc_idx"][e * 30:(e + 1) * 30].tolist()) == list(range(30))
    shuffle = np.asarray(a["shuffle_idx"], dtype=np.int64)
    assert sorted(shuffle.tolist()) == list(range(len(ds)))
    start = 0
    for end in ds.block_ends:  # shuffled within each epoch's block of samples
        assert sorted(shuffle[start:end].tolist()) == list(range(start, end))
        start = end
    stream = stream_of(ds)
    for i in range(len(ds)):
        j = int(shuffle[i])
        np.testing.assert_array_equal(ds.tokens(i), stream[j * 7:j * 7 + 8])
    item = ds[5]
    assert set(item) == {"input_ids", "labels", "position_ids"}
    assert all(v.dtype == torch.int64 and v.shape == (7,) for v in item.values())
    t = torch.from_numpy(ds.tokens(5))
    assert torch.equal(item["input_ids"], t[:-1]) and torch.equal(item["labels"], t[1:])
    assert torch.equal(item["position_ids"], torch.arange(7))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_order_is_prefix_stable_across_num_samples(tmp_path):
    """Asking for more samples (a longer or resumed run) keeps every earlier sample in place."""
    idx = IndexedDataset(write_docs(tmp_path / "d", random_docs(25, seed=1)))
    small = GPTDataset(idx, (0, 25), seq_length=5, num_samples=10, seed=9,
                       cache_dir=str(tmp_path / "c"))
    big = GPTDataset(idx, (0, 25), seq_length=5, num_samples=1000, seed=9,
                     cache_dir=str(tmp_path / "c"))
    assert big.num_epochs > small.num_epochs
    for ds in (small, big):
        ds.prepare()
    assert big.cache.hash != small.cache.hash
    for i in range(len(small)):
        np.testing.assert_array_equal(small.tokens(i), big.tokens(i))


def test_eod_mask_and_reset_positions_by_hand():
    toks = np.array([5, 6, EOD, 7, 8, EOD, 9])
    plain = make_item(toks, EOD, False, False)
    assert plain["input_ids"].tolist() == [5, 6, 2, 7, 8, 2]
    assert plain["labels"].tolist() == [6, 2, 7, 8, 2, 9]
    assert plain["position_ids"].tolist() == [0, 1, 2, 3, 4, 5]
    masked = make_item(toks, EOD, True, False)
    # the label whose *input* is eod (the next document's first token) is ignored;
    # predicting eod itself is still trained
    assert masked["labels"].tolist() == [6, 2, -100, 8, 2, -100]
    assert masked["position_ids"].tolist() == [0, 1, 2, 3, 4, 5]
    reset = make_item(toks, EOD, False, True)
    assert reset["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]
    assert reset["labels"].tolist() == plain["labels"].tolist()
    both = make_item(np.array([EOD, EOD, 4, 5, EOD]), EOD, True, True)
    assert both["labels"].tolist() == [-100, -100, 5, 2]
    assert both["position_ids"].tolist() == [0, 0, 0, 1]


def test_eod_flags_through_build_data(tmp_path, tok_model):
    prefix = write_docs(tmp_path / "d", random_docs(40, seed=2))
    args = make_args(data_path=[prefix], tokenizer_model=tok_model, split="1", seq_length=12,
                     eod_mask_loss=True, reset_position_ids=True,
                     data_cache_path=str(tmp_path / "c"))
    b = build_data(args, (50, 0, 0), mock_vocab_size=0)
    assert b.vocab_size == 256 and b.eod_id == EOD and b.valid is None and b.test is None
    saw_eod = 0
    for i in range(len(b.train)):
        x = b.train[i]
        is_eod = x["input_ids"] == EOD
        saw_eod += int(is_eod.sum())
        assert torch.equal(x["labels"] == -100, is_eod)
        pos = x["position_ids"]
        for t in range(1, 12):
            assert pos[t] == (0 if is_eod[t - 1] else pos[t - 1] + 1)
    assert saw_eod > 10


def test_splits(tmp_path, tok_model):
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("8/2") == pytest.approx([0.8, 0.2, 0.0])
    for bad in ("1,2,3,4", "-1,2", "0,0", "a,b"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    assert split_ranges(734, parse_split("969,30,1")) == [(0, 711), (711, 733), (733, 734)]
    assert split_ranges(10, parse_split("8,1,1")) == [(0, 8), (8, 9), (9, 10)]
    assert split_ranges(3, parse_split("1,1,1")) == [(0, 1), (1, 2), (2, 3)]
    prefix = write_docs(tmp_path / "d", random_docs(10, seed=3))
    args = make_args(data_path=[prefix], tokenizer_model=tok_model, split="8,2,0", seq_length=4,
                     data_cache_path=str(tmp_path / "c"))
    b = build_gpt_datasets(args, (20, 5, 5))
    assert b.test is None
    assert set(b.train._a()["doc_idx"].tolist()) == set(range(8))
    assert set(b.valid._a()["doc_idx"].tolist()) == {8, 9}
    assert "train:" in b.description and "valid:" in b.description


def test_cache_reuse_and_invalidation(tmp_path, tok_model):
    prefix = write_docs(tmp_path / "d", random_docs(50, seed=4))
    cache = tmp_path / "c"
    base = dict(data_path=[prefix], tokenizer_model=tok_model, split="90,10,0", seq_length=8,
                seed=1, data_cache_path=str(cache))

    def build(n=(100, 10, 0), **kw):
        return build_gpt_datasets(make_args(**{**base, **kw}), n)

    first = build()
    assert first.train.cache.built and first.valid.cache.built
    files = sorted(os.listdir(cache))
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}
    again = build()
    assert not again.train.cache.built and not again.valid.cache.built
    assert sorted(os.listdir(cache)) == files
    assert {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes
    np.testing.assert_array_equal(first.train.tokens(3), again.train.tokens(3))
    # same number of epochs -> same arrays, reused
    assert not build(n=(first.train.num_samples, 10, 0)).train.cache.built
    for change in (dict(seq_length=16), dict(seed=2), dict(split="80,20,0"),
                   dict(n=(first.train.num_samples + 1, 10, 0))):
        n = change.pop("n", (100, 10, 0))
        b = build(n=n, **change)
        assert b.train.cache.built, change
    # rewriting the data invalidates too (size/mtime are in the key)
    os.utime(prefix + ".bin", ns=(1, 1))
    assert build().train.cache.built


def test_blending_proportions_and_cache(tmp_path, tok_model):
    prefixes = []
    for j in range(3):  # dataset j's tokens lie in [10 + 60 j, 70 + 60 j)
        prefixes.append(write_docs(tmp_path / f"d{j}", random_docs(40, seed=10 + j,
                                                                  lo=10 + 60 * j, hi=70 + 60 * j)))
    data_path = ["2", prefixes[0], "3", prefixes[1], "5", prefixes[2], "0", prefixes[0] + "x"]
    assert [w for w, _ in parse_data_path(data_path)] == pytest.approx([0.2, 0.3, 0.5])
    args = make_args(data_path=data_path, tokenizer_model=tok_model, split="1", seq_length=6,
                     data_cache_path=str(tmp_path / "c"))
    n = 3000
    b = build_gpt_datasets(args, (n, 0, 0))
    assert isinstance(b.train, BlendedDataset) and len(b.train) == n
    a = b.train._a()
    counts = np.cumsum(np.eye(3, dtype=np.int64)[np.asarray(a["dataset_index"])], axis=0)
    expected = np.arange(1, n + 1)[:, None] * np.array([0.2, 0.3, 0.5])
    assert np.abs(counts - expected).max() <= 1.0  # tracks the weights at every prefix
    for i in range(0, n, 37):  # every item comes from the dataset the index names
        j = int(a["dataset_index"][i])
        toks = b.train[i]["input_ids"].numpy()
        toks = toks[toks != EOD]
        assert toks.min() >= 10 + 60 * j and toks.max() < 70 + 60 * j
    assert np.array_equal(b.train[7]["input_ids"], b.train.datasets[int(a["dataset_index"][7])][
        int(a["dataset_sample_index"][7])]["input_ids"])
    again = build_gpt_datasets(args, (n, 0, 0))
    assert not again.train.cache.built
    # a longer run keeps the blend order (prefix-stable), built into a new cache
    longer = build_gpt_datasets(args, (2 * n, 0, 0))
    assert longer.train.cache.built
    np.testing.assert_array_equal(longer.train._a()["dataset_index"][:n], a["dataset_index"])
    for i in (0, 1, 500, n - 1):
        assert torch.equal(longer.train[i]["labels"], b.train[i]["labels"])


def test_blend_index_is_greedy_exact():
    di, si = build_blend_indices([1, 1], 6)
    assert di.tolist() == [0, 1, 0, 1, 0, 1] and si.tolist() == [0, 0, 1, 1, 2, 2]
    di, _ = build_blend_indices([0.9, 0.1], 200_000)  # several merge windows
    assert abs(np.bincount(di)[1] - 20_000) <= 1
    with pytest.raises(ValueError):
        build_blend_indices([1, 0], 5)


def test_bad_configurations(tmp_path, tok_model):
    prefix = write_docs(tmp_path / "d", random_docs(10, seed=5))
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_data(make_args(data_path=[prefix]), (10, 0, 0), mock_vocab_size=0)
    with pytest.raises(FileNotFoundError, match="nothere.idx"):
        build_gpt_datasets(make_args(data_path=[str(tmp_path / "nothere")],
                                     tokenizer_model=tok_model), (10, 0, 0))
    with pytest.raises(ValueError, match="pairs"):
        parse_data_path(["1", prefix, "2"])
    with pytest.raises(ValueError, match="not a number"):
        parse_data_path(["x", prefix])
    # data made with a bigger vocabulary than the tokenizer's
    big = write_docs(tmp_path / "big", [[5, 300, 6, EOD]] * 5)
    b = build_gpt_datasets(make_args(data_path=[big], tokenizer_model=tok_model, split="1",
                                     seq_length=4, data_cache_path=str(tmp_path / "c")),
                           (3, 0, 0))
    with pytest.raises(ValueError, match="token id 300 is outside the tokenizer's vocabulary"):
        b.train[0]


def test_loader_workers_and_pickling(tmp_path, tok_model):
    prefix = write_docs(tmp_path / "d", random_docs(30, seed=6))
    b = build_gpt_datasets(make_args(data_path=[prefix], tokenizer_model=tok_model, split="1",
                                     seq_length=8, data_cache_path=str(tmp_path / "c")),
                           (64, 0, 0))
    ds = b.train
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._arrays is None and torch.equal(clone[11]["input_ids"], ds[11]["input_ids"])
    loader = build_loader(ds, micro_batch_size=4, global_batch_size=8, dp_rank=1, dp_size=2,
                          consumed_samples=16, num_workers=2)
    batches = list(loader)
    assert len(batches) == (len(ds) - 16) // 8
    for k, batch in enumerate(batches[:3]):
        first = 16 + k * 8 + 4
        want = torch.stack([ds[i]["input_ids"] for i in range(first, first + 4)])
        assert torch.equal(batch["input_ids"], want) and batch["labels"].shape == (4, 8)


def test_default_cache_locations(tmp_path, tok_model, monkeypatch):
    prefix = write_docs(tmp_path / "d", random_docs(20, seed=11))
    args = make_args(data_path=[prefix], tokenizer_model=tok_model, split="1", seq_length=8)
    monkeypatch.delenv("AUTOSP_LM_CACHE", raising=False)
    b = build_gpt_datasets(args, (10, 0, 0))
    assert b.train.cache.directory == str(tmp_path / "cache")  # next to the data
    assert any(f.endswith("-meta.json") for f in os.listdir(tmp_path / "cache"))
    monkeypatch.setenv("AUTOSP_LM_CACHE", str(tmp_path / "env"))
    b = build_gpt_datasets(args, (10, 0, 0))
    assert b.train.cache.directory == str(tmp_path / "env") and b.train.cache.built
