"""The whole workflow: a Hugging Face Llama (and Qwen3) with its tokenizer -> preprocess data with
that tokenizer -> `pretrain.py --hf-checkpoint --autosp` on 2 ranks at 4x the original context
with YaRN, 2 iterations, save -> `tools/export_hf.py` -> transformers loads the export and its
logits equal our model's, from the training checkpoint, at the extended length. (Qwen2 runs the
same way with `-m slow`, to keep the default suite short.) The default suite's 2-rank run
(Llama 3: the checkpoint, the tokenizer, the data and the training) is an item of the session's
shared launch (tests/helpers/launch.py); ``-m slow``'s families run in launches of their own."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import traceback

import pytest
import torch

from tests.data.test_hf_tokenizer import TEXTS, train_bpe
from tests.helpers.dist import run_distributed
from tests.helpers.hf_cases import make_hf_model, pretrain_worker, save_hf_model
from tests.helpers.launch import Job

transformers = pytest.importorskip("transformers")

ORIGINAL, SEQ, VOCAB = 16, 64, 320  # continue pretraining at 4x the checkpoint's context
#: the run's flags; ``{root}``: the directory :func:`yarn_worker` makes
ARGV = ["--hf-checkpoint", "{root}/pretrained", "--data-path", "{root}/data/corpus_text_document",
        "--split", "1,0,0", "--autosp", "--compile-backend", "aot_eager", "--seq-length", str(SEQ),
        "--rope-scaling", "yarn", "--rope-scaling-factor", "4",
        "--train-iters", "2", "--global-batch-size", "2", "--micro-batch-size", "1",
        "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1",
        "--save", "{root}/ckpt"]


def _prepare(root: str, family: str) -> None:
    """A pretrained checkpoint directory, as the Hub has them (config.json, safetensors,
    tokenizer), and a corpus preprocessed with its tokenizer, under ``root``."""
    from tools.preprocess_data import main as preprocess_main
    src = os.path.join(root, "pretrained")
    save_hf_model(make_hf_model(family, vocab_size=VOCAB, max_position_embeddings=ORIGINAL), src)
    train_bpe(src, vocab_size=VOCAB)
    corpus = os.path.join(root, "corpus.jsonl")
    with open(corpus, "w") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 10))
    prefix = os.path.join(root, "data", "corpus")
    assert preprocess_main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-model", src,
                            "--append-eod", "--workers", "1", "--no-progress"]) == 0


def yarn_worker(rank, world, family):
    """Rank 0 prepares the run (:func:`_prepare`) in a new directory that every rank then uses
    (the test removes it), every rank runs `pretrain.py` with :data:`ARGV`; -> the rank's
    losses, grad norms and iteration, and the directory (``root``)."""
    import torch.distributed as dist
    shared = [None, None]  # the directory, rank 0's traceback if it could not prepare it
    if rank == 0:
        shared[0] = tempfile.mkdtemp(prefix="autosp_lm_hf_roundtrip_")
        try:
            _prepare(shared[0], family)
        except Exception:  # noqa: BLE001 - raised on every rank below (none waits for rank 0)
            shutil.rmtree(shared[0], ignore_errors=True)
            shared[1] = traceback.format_exc()
    dist.broadcast_object_list(shared, src=0)
    root, error = shared
    if error is not None:
        raise RuntimeError(f"rank 0 could not prepare the run:\n{error}")
    res = pretrain_worker(rank, world, [a.format(root=root) for a in ARGV])
    return dict(res, root=root)


YARN = Job("tests.models.test_hf_roundtrip:yarn_worker", ("llama-3",))
LAUNCH = {2: [YARN]}  # in the session's shared launch (tests/helpers/launch.py)


@pytest.mark.parametrize("family", ["llama-3"])
def test_import_extend_with_yarn_under_autosp_export(family, launch2, tmp_path):
    _check_export(launch2(Job(YARN.fn, (family,))), tmp_path)


@pytest.mark.slow  # the same on more families, a launch each
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_import_extend_with_yarn_under_autosp_export_more_families(family, tmp_path):
    _check_export(run_distributed(yarn_worker, 2, family), tmp_path)


def _check_export(per_rank, tmp_path):
    root = per_rank[0]["root"]
    try:
        _check_run_and_export(per_rank, root, tmp_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check_run_and_export(per_rank, root, tmp_path):
    from tools.export_hf import main as export_main
    from tools.export_hf import read_checkpoint

    src, save = os.path.join(root, "pretrained"), os.path.join(root, "ckpt")
    assert per_rank[0]["iteration"] == 2 and per_rank[0]["losses"] == per_rank[1]["losses"]
    assert all(0 < v < 20 for v in per_rank[0]["losses"].values())

    out = str(tmp_path / "exported")
    assert export_main(["--load", save, "--output", out]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    assert hf_cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": ORIGINAL,
                                      "beta_fast": 32.0, "beta_slow": 1.0}
    assert hf_cfg["max_position_embeddings"] == SEQ and hf_cfg["eos_token_id"] == 0

    # our model from the training checkpoint vs transformers on the export, at the extended length
    cfg, state, _ = read_checkpoint(os.path.join(save, "iter_0000002"))
    from autosp_lm.models import build_model
    ours = build_model(cfg)
    ours.load_state_dict(state)
    ours.eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, theirs = ours(ids), exported(input_ids=ids).logits
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    # training moved the weights away from the pretrained ones
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    emb = pretrained.get_input_embeddings().weight
    assert not torch.allclose(emb, ours.embed_tokens.weight)
    # the exported tokenizer is the run's
    from autosp_lm.data.tokenizer import HuggingFaceTokenizer
    assert HuggingFaceTokenizer(out).encode(TEXTS[0]) == HuggingFaceTokenizer(src).encode(TEXTS[0])
