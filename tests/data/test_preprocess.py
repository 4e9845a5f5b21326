"""Tokenizer training, preprocessing (functions and the CLI tools) and bad inputs."""
from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

from autosp_lm.data.indexed_dataset import IndexedDataset
from autosp_lm.data.preprocess import preprocess_files
from autosp_lm.data.sources import BadLineError, iter_records
from autosp_lm.data.tokenizer import Tokenizer, sample_sentences
from tests.helpers.data import (make_texts, read_megatron, run_tool, tool_main,
                                     train_tiny_tokenizer, write_jsonl)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep")
    texts = make_texts(200, seed=1)
    model = train_tiny_tokenizer(d, texts, 256)
    return d, texts, model


def test_cli_tools_round_trip(tmp_path):
    """train_tokenizer.py + preprocess_data.py (a subprocess from another directory, with 2
    worker processes): text -> tokens -> .bin/.idx -> the same text."""
    texts = make_texts(150, seed=2)
    a = write_jsonl(tmp_path / "a.jsonl", texts[:100])
    b = tmp_path / "b.txt"
    b.write_text(texts[100], encoding="utf-8")
    assert tool_main("train_tokenizer.py", "--input", a, b, "--output-prefix", tmp_path / "tok",
                     "--vocab-size", 240) == 0
    tok = Tokenizer(tmp_path / "tok.model")
    assert tok.vocab_size == 240 and tok.eod_id == 2 and (tmp_path / "tok.vocab").exists()
    out = run_tool("preprocess_data.py", "--input", a, b, "--output-prefix", tmp_path / "out",
                   "--tokenizer-model", tmp_path / "tok.model", "--append-eod", "--workers", 2)
    assert "101 documents" in out.stdout
    prefix = str(tmp_path / "out_text_document")
    ds = IndexedDataset(prefix)
    assert len(ds) == 101 and ds.dtype == np.uint16
    for i, t in enumerate(texts[:101]):
        assert ds[i][-1] == tok.eod_id
        assert tok.decode(ds[i]) == t  # exact: indentation, newlines and "é" survive
    # the parallel tool writes the same bytes as the in-process path
    preprocess_files([a, str(b)], str(tmp_path / "one"), str(tmp_path / "tok.model"),
                     append_eod=True, workers=1, progress=False)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == \
            open(str(tmp_path / "one_text_document") + ext, "rb").read()


def test_tokenizer_wrapper(corpus):
    d, texts, model = corpus
    tok = Tokenizer(model)
    ids = tok.encode(texts[0])
    assert tok.decode(ids) == texts[0] and tok.decode(np.array(ids)) == texts[0]
    assert tok.encode(texts[:2]) == [tok.encode(texts[0]), tok.encode(texts[1])]
    assert tok.encode("ka", append_eod=True)[-1] == tok.eod_id == 2
    assert (tok.unk_id, tok.bos_id, tok.pad_id) == (0, 1, 3)
    ids2 = pickle.loads(pickle.dumps(tok)).encode(texts[3])
    assert ids2 == tok.encode(texts[3])
    padded, mask = tok.pad([[5, 6, 7], [8]], 4)
    assert padded.tolist() == [[5, 6, 7, 3], [8, 3, 3, 3]]
    assert mask.tolist() == [[True] * 3 + [False], [True] + [False] * 3]
    left, _ = tok.pad([[5, 6]], 3, left=True)
    assert left.tolist() == [[3, 5, 6]]
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer(str(d / "nope.model"))


def test_unigram_and_sampling(tmp_path):
    texts = make_texts(120, seed=4)
    from autosp_lm.data.tokenizer import train_sentencepiece, training_sentences
    model = train_sentencepiece(training_sentences(texts), tmp_path / "uni", 200,
                                model_type="unigram", max_sentences=300, num_threads=1)
    tok = Tokenizer(model)
    assert tok.vocab_size == 200 and tok.decode(tok.encode(texts[5])) == texts[5]
    s1 = sample_sentences((str(i) for i in range(1000)), 10, seed=0)
    assert s1 == sample_sentences((str(i) for i in range(1000)), 10, seed=0) and len(s1) == 10
    assert sample_sentences(["a", "b"], 10) == ["a", "b"]


def test_multiple_json_keys_and_empty_documents(corpus, tmp_path):
    d, texts, model = corpus
    path = tmp_path / "k.jsonl"
    with open(path, "w") as f:
        for i, t in enumerate(texts[:20]):
            f.write(json.dumps({"text": t, "title": "" if i % 5 == 0 else f"ka lo {i}"}) + "\n")
        f.write("\n")  # blank lines are not documents
        f.write(json.dumps({"text": "", "title": "mi"}) + "\n")
    st = preprocess_files([str(path)], str(tmp_path / "o"), model, json_keys=["text", "title"],
                          progress=False)
    assert st.documents == {"text": 20, "title": 17}
    assert st.empty_documents == {"text": 1, "title": 4}
    assert len(IndexedDataset(str(tmp_path / "o_title_document"))) == 17
    assert len(read_megatron(str(tmp_path / "o_text_document"))["docs"]) == 20


def test_plain_text_document_modes(corpus, tmp_path):
    d, texts, model = corpus
    p = tmp_path / "t.txt"
    p.write_text("ka lo\nmi ne\n\nsu ta\n\n\nri po\n", encoding="utf-8")
    count = {m: preprocess_files([str(p)], str(tmp_path / m), model, document_per=m,
                                 progress=False).documents["text"]
             for m in ("file", "line", "paragraph")}
    assert count == {"file": 1, "line": 4, "paragraph": 3}
    recs = list(iter_records([str(p)], "paragraph"))
    assert [(r.lineno, r.payload) for r in recs] == [(1, "ka lo\nmi ne"), (4, "su ta"), (7, "ri po")]


def _bad_jsonl(path, texts):
    lines = [json.dumps({"text": texts[0]}), json.dumps({"text": texts[1]}),
             '{"text": "unterminated',  # line 3: malformed JSON
             json.dumps({"text": texts[2]}),
             json.dumps(["not", "an", "object"]),  # line 5
             json.dumps({"body": "wrong key"}),  # line 6
             json.dumps({"text": 42}),  # line 7
             json.dumps({"text": texts[3]})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_malformed_jsonl_names_file_and_line(corpus, tmp_path, capsys):
    d, texts, model = corpus
    path = _bad_jsonl(tmp_path / "bad.jsonl", texts)
    with pytest.raises(BadLineError, match=r"bad\.jsonl:3: malformed JSON") as e:
        preprocess_files([path], str(tmp_path / "o"), model, workers=2, progress=False)
    assert e.value.path == path and e.value.lineno == 3
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o_")]  # no partial output
    rc = tool_main("preprocess_data.py", "--input", path, "--output-prefix", tmp_path / "o",
                   "--tokenizer-model", model, "--workers", 1)
    err = capsys.readouterr().err
    assert rc == 1 and f"{path}:3: malformed JSON" in err and "--skip-bad-lines" in err


def test_skip_bad_lines_counts(corpus, tmp_path, capsys):
    d, texts, model = corpus
    path = _bad_jsonl(tmp_path / "bad.jsonl", texts)
    st = preprocess_files([path], str(tmp_path / "o"), model, skip_bad_lines=True, workers=1,
                          progress=False)
    assert st.bad_lines == 4 and st.documents["text"] == 4
    assert [m.split(": ")[0].rsplit(":", 1)[1] for m in st.bad_examples] == ["3", "5", "6", "7"]
    assert "no key 'text'" in st.bad_examples[2] and "holds int" in st.bad_examples[3]
    tok = Tokenizer(model)
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [tok.decode(ds[i]) for i in range(4)] == texts[:4]
    assert tool_main("preprocess_data.py", "--input", path, "--output-prefix", tmp_path / "c",
                     "--tokenizer-model", model, "--skip-bad-lines", "--no-progress",
                     "--workers", 1) == 0
    assert "4 malformed lines skipped" in capsys.readouterr().out
    # the tokenizer trainer reads the same way
    rc = tool_main("train_tokenizer.py", "--input", path, "--output-prefix", tmp_path / "t",
                   "--vocab-size", 60)
    assert rc == 1 and f"{path}:3:" in capsys.readouterr().err
    assert tool_main("train_tokenizer.py", "--input", path, "--output-prefix", tmp_path / "t",
                     "--vocab-size", 60, "--skip-bad-lines") == 0
    assert "skipped 4 malformed lines" in capsys.readouterr().err


def test_missing_input_file(corpus, tmp_path, capsys):
    d, texts, model = corpus
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        preprocess_files([missing], str(tmp_path / "o"), model, progress=False)
    assert tool_main("preprocess_data.py", "--input", missing, "--output-prefix", tmp_path / "o",
                     "--tokenizer-model", model) == 1
    assert "input file not found" in capsys.readouterr().err
    assert tool_main("train_tokenizer.py", "--input", missing, "--output-prefix", tmp_path / "t",
                     "--vocab-size", 60) == 1
    assert "missing.jsonl" in capsys.readouterr().err
    assert tool_main("preprocess_data.py", "--input", write_jsonl(tmp_path / "x.jsonl", ["ka"]),
                     "--output-prefix", tmp_path / "o", "--tokenizer-model",
                     tmp_path / "nope.model") == 1
    assert "nope.model" in capsys.readouterr().err
