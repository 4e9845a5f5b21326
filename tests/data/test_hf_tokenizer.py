"""HuggingFaceTokenizer: a `tokenizers` byte-level BPE trained here; tools/preprocess_data.py
output decodes back to the texts; pretrain.py trains on it."""
from __future__ import annotations

import json
import os
import pickle

import pytest

pytest.importorskip("tokenizers")

from autosp_lm.data.indexed_dataset import IndexedDataset  # noqa: E402
from autosp_lm.data.tokenizer import HuggingFaceTokenizer, build_tokenizer  # noqa: E402

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Long-context pretraining rarely starts from random weights.\n\n  Indented   spacing\tand tabs.",
    "Unicode: naïve café — 東京 🚀, and a trailing space ",
    "x = [i ** 2 for i in range(10)]  # squares\n" * 3,
]
EOS = "<|endoftext|>"


def train_bpe(directory, vocab_size=320, with_config=True) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 20, trainer=trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if with_config:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": EOS, "pad_token": {"content": "<pad>"}}, f)
    return str(directory)


def test_encode_decode_ids_and_pickle(tmp_path):
    d = train_bpe(tmp_path / "tok")
    tok = build_tokenizer("HuggingFaceTokenizer", d)
    assert isinstance(tok, HuggingFaceTokenizer) and tok.model_path.endswith("tokenizer.json")
    assert tok.eod_id == tok.piece_to_id(EOS) == 0 and tok.pad_id == 1 and tok.vocab_size == 320
    for text in TEXTS:
        ids = tok.encode(text, append_eod=True)
        assert ids[-1] == tok.eod_id and tok.decode(ids) == text
    assert tok.encode(TEXTS) == [tok.encode(t) for t in TEXTS]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(TEXTS[2]) == tok.encode(TEXTS[2]) and clone.eod_id == tok.eod_id
    # inferred type from the path; the sentencepiece default for a .model path stays
    assert isinstance(build_tokenizer(None, d), HuggingFaceTokenizer)


def test_eos_without_tokenizer_config(tmp_path):
    d = train_bpe(tmp_path / "tok", with_config=False)
    assert HuggingFaceTokenizer(d).eod_id == 0  # a well-known eos name in the vocabulary
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"eos_token_id": 1}, f)
    assert HuggingFaceTokenizer(d).eod_id == 1  # the model's config wins over guessing
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        HuggingFaceTokenizer(tmp_path)


def test_preprocess_decodes_back_and_pretrain_trains(tmp_path):
    import pretrain
    from tools.preprocess_data import main as preprocess_main

    d = train_bpe(tmp_path / "tok")
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for t in TEXTS * 8:
            f.write(json.dumps({"text": t}) + "\n")
    prefix = str(tmp_path / "data" / "corpus")
    rc = preprocess_main(["--input", str(corpus), "--output-prefix", prefix, "--tokenizer-type",
                          "HuggingFaceTokenizer", "--tokenizer-model", d, "--append-eod", "--workers", "2",
                          "--no-progress"])
    assert rc == 0
    tok = HuggingFaceTokenizer(d)
    ds = IndexedDataset(prefix + "_text_document")
    assert len(ds) == len(TEXTS) * 8
    for i in range(len(ds)):
        doc = ds[i].tolist()
        assert doc[-1] == tok.eod_id  # the end-of-document id is the tokenizer's eos
        assert tok.decode(doc[:-1]) == TEXTS[i % len(TEXTS)]
    res = pretrain.main(["--data-path", prefix + "_text_document", "--tokenizer-type", "HuggingFaceTokenizer",
                         "--tokenizer-model", d, "--model", "llama-tiny", "--seq-length", "32",
                         "--global-batch-size", "2", "--train-iters", "2", "--eval-iters", "0",
                         "--log-interval", "1", "--split", "1,0,0", "--lr-warmup-iters", "0"])
    assert res.iteration == 2 and all(0 < v < 20 for v in res.losses.values())
