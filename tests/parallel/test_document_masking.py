"""Packed documents (``--reset-attention-mask``): attention within each document, exact through
every strategy, on samples where documents straddle shard boundaries and span several shards."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autosp_lm.data.gpt_dataset import document_ids_of, make_item
from autosp_lm.models import build_model, preset_config
from autosp_lm.models.attention import document_block_mask, document_mask
from tests.helpers.dist import run_distributed
from tests.helpers.launch import Job

TOL = 1e-5
SEQ = 32
# per sample: the first position of each document after the first; with P=2 the shard boundary
# is 16, with P=4 8/16/24: boundaries on, just before and after them, a document over 3 shards
CUTS = [[3, 20], [8, 11, 16]]


def packed_batch(vocab: int, seq: int = SEQ, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(CUTS), seq), generator=g)
    doc = torch.zeros(len(CUTS), seq, dtype=torch.long)
    for b, cuts in enumerate(CUTS):
        for c in cuts:
            doc[b, c:] += 1
    pos = torch.arange(seq).expand(len(CUTS), seq).clone()
    for b in range(len(CUTS)):
        for c in CUTS[b]:
            pos[b, c:] -= pos[b, c].clone()
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": doc}


# ---------------------------------------------------------------------------- single process
def test_items_carry_document_ids():
    eod = 2
    toks = np.array([5, 6, eod, 7, eod, eod, 9, 9, 4])
    assert document_ids_of(toks[:-1], eod).tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    item = make_item(toks, eod, eod_mask_loss=True, reset_position_ids=True,
                     reset_attention_mask=True)
    assert item["document_ids"].tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]  # the same boundaries
    assert "document_ids" not in make_item(toks, eod, False, True, False)


@pytest.mark.parametrize("model", ["llama-tiny", "gpt-tiny"])
def test_masking_is_real_and_equals_documents_run_alone(model):
    torch.manual_seed(0)
    m = build_model(preset_config(model))
    b = packed_batch(m.config.vocab_size)
    ids, pos, doc, lab = b["input_ids"], b["position_ids"], b["document_ids"], b["labels"]
    masked = m(ids, position_ids=pos, labels=lab, document_ids=doc)
    masked_logits = m(ids, position_ids=pos, document_ids=doc)
    unmasked_logits = m(ids, position_ids=pos)
    alone = torch.zeros_like(masked_logits)  # each document through the model on its own
    total, count = 0.0, 0
    for i in range(len(CUTS)):
        edges = [0] + CUTS[i] + [SEQ]
        for lo, hi in zip(edges[:-1], edges[1:]):
            logits = m(ids[i:i + 1, lo:hi], position_ids=pos[i:i + 1, lo:hi])
            alone[i, lo:hi] = logits[0]
            total += F.cross_entropy(logits[0].float(), lab[i, lo:hi], reduction="sum").item()
            count += int((lab[i, lo:hi] != -100).sum())
    assert masked.item() == pytest.approx(total / count, rel=TOL)
    rel = lambda a, c: ((a - c).norm() / c.norm()).item()  # noqa: E731
    assert rel(masked_logits, alone) <= TOL
    # without the mask, tokens after the first boundary see the previous documents
    assert rel(unmasked_logits, alone) > 100 * TOL, rel(unmasked_logits, alone)


def test_block_mask_from_document_ranges_equals_the_dense_mask():
    from torch.nn.attention.flex_attention import flex_attention
    torch.manual_seed(0)
    for seq, block in ((100, 32), (64, 16), (300, 128)):
        doc = torch.zeros(2, seq, dtype=torch.long)
        for b, cuts in enumerate([[5, 37, 38, 90], [seq // 2]]):
            for c in cuts:
                if c < seq:
                    doc[b, c:] += 1
        q, k, v = (torch.randn(2, 4, seq, 8) for _ in range(3))
        for causal in (True, False):
            with torch.no_grad():
                out = flex_attention(q, k, v, block_mask=document_block_mask(doc, causal, block))
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc, causal))
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_ring_blocks_with_masks_skip_and_merge_exactly():
    """One rank (a ring of one): every block kernel path with a document mask equals SDPA."""
    from autosp_lm.parallel.ring import ring_attention
    torch.manual_seed(0)
    doc = packed_batch(64)["document_ids"]
    q, k, v = (torch.randn(2, 4, SEQ, 8, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc))
    g2 = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for kernel in ("cpu_flash", "math"):
        out = ring_attention(q, k, v, kernel=kernel, document_ids=doc)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        g1 = torch.autograd.grad(out.square().sum(), (q, k, v))
        for a, c in zip(g1, g2):
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not cover the whole sequence"):
        ring_attention(q, k, v, document_ids=doc[:, :8])


# ---------------------------------------------------------------------------- distributed
STRATEGIES = [("ulysses", {}), ("ring", {}), ("autosp", {"sac": False}),
              ("autosp", {"sac": True})]
#: the default suite's: each strategy kind once (AutoSP without SAC, aot_eager); SAC under the
#: masks and AutoSP on models that build their own masks (``packed``) run under -m slow
DEFAULT_STRATEGIES = STRATEGIES[:3]


def _grads(model):
    return {n: p.grad.detach().clone().numpy() if p.grad is not None else None
            for n, p in model.named_parameters()}


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def one_device_step(cfg):
    """The packed batch of ``cfg``'s vocabulary and one device's step on it (seed 0): (batch,
    model with its gradients, loss)."""
    batch = packed_batch(cfg.vocab_size)
    torch.manual_seed(0)
    model = build_model(cfg)
    loss = model(batch["input_ids"], position_ids=batch["position_ids"],
                 labels=batch["labels"], document_ids=batch["document_ids"])
    loss.backward()
    return batch, model, loss


def worker(rank, world, models=("llama-tiny", "gpt-tiny"), strategies=STRATEGIES, packed=True):
    """Each of ``strategies`` on each of ``models`` (one layer) against one device under the
    document masks; with ``packed``, AutoSP on a model that builds its own mask from the document
    ids (an additive SDPA mask, and FlexAttention's block mask, forward only)."""
    import torch.distributed as dist

    from autosp_lm.compiler import autosp_compile
    from autosp_lm.parallel.grads import reduce_gradients
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy, extract_loss
    from tests.helpers.decoders.packed_style import PackedLM
    torch.set_num_threads(1)
    out = {}
    for model_name in models:
        cfg = preset_config(model_name, num_layers=1)  # masks, not layer-to-layer behaviour
        batch, ref_model, ref = one_device_step(cfg)
        ref_grads = _grads(ref_model)
        for name, options in strategies:
            if model_name == "gpt-tiny" and name == "autosp" and options["sac"]:
                continue
            torch._dynamo.reset()
            ps = init_parallel(world)
            torch.manual_seed(0)
            model = build_model(cfg)
            opts = dict(options, backend="aot_eager", verbose=False) if name == "autosp" else {}
            strategy = build_strategy(name, ps, **opts)
            strategy.setup(model)
            loss, reported = strategy.forward_loss(batch)
            loss.backward()
            reduce_gradients(model.parameters(), ps.dp_size)
            g = _grads(model)
            out[f"{model_name}/{name}{'-sac' if options.get('sac') else ''}"] = dict(
                loss=reported.item(), ref=ref.item(),
                grad_err=max(_rel(g[n], ref_grads[n]) for n in ref_grads),
                report=strategy.report())
    # a model that builds its own additive mask from document ids, through autosp_compile
    for attn in ("sdpa", "flex") if packed else ():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = PackedLM(attn=attn)
        batch = packed_batch(256)
        kwargs = dict(input_ids=batch["input_ids"], labels=batch["labels"],
                      document_ids=batch["document_ids"])
        grad = attn == "sdpa"  # FlexAttention has no CPU backward: forward only
        with torch.set_grad_enabled(grad):
            ref_out = model(**kwargs)
            if grad:
                ref_out["loss"].backward()
            ref_grads = _grads(model)
            model.zero_grad(set_to_none=True)
            run = autosp_compile(model, backend="aot_eager", sac=False, verbose=False)
            res = run(**kwargs)
            loss = extract_loss(res)
            chunk = SEQ // world
            want = ref_out["logits"][:, rank * chunk:(rank + 1) * chunk]
            entry = dict(loss=loss.item(), ref=ref_out["loss"].item(),
                         logits_err=_rel(res["logits"].detach().numpy(), want.detach().numpy()),
                         report=run.report.as_dict())
            if grad:
                loss.backward()
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                g = _grads(model)
                entry["grad_err"] = max(_rel(g[n], ref_grads[n]) for n in ref_grads)
        out[f"packed-{attn}/autosp"] = entry
    return out


# 2 ranks: llama-tiny, each strategy kind once (the default suite); -m slow: every strategy and
# the packed models on 2 ranks (llama-tiny) and 4 (both models)
WORKER_2 = Job("tests.parallel.test_document_masking:worker",
               (("llama-tiny",), DEFAULT_STRATEGIES, False))
LAUNCH = {2: [WORKER_2]}
DEFAULT_KEYS = ["llama-tiny/ulysses", "llama-tiny/ring", "llama-tiny/autosp"]
SLOW_KEYS = ["llama-tiny/autosp-sac", "gpt-tiny/ulysses", "gpt-tiny/ring", "gpt-tiny/autosp",
             "packed-sdpa/autosp"]


def _same_loss_on_every_rank(per_rank):
    for key in per_rank[0]:
        assert len({r[key]["loss"] for r in per_rank}) == 1, f"{key}: ranks report different losses"
    return per_rank


@pytest.fixture(scope="module")
def results(launch2):
    return _same_loss_on_every_rank(launch2(WORKER_2))  # the session's shared launch


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def more_results(request):
    models = ("llama-tiny",) if request.param == 2 else ("llama-tiny", "gpt-tiny")
    return _same_loss_on_every_rank(run_distributed(worker, request.param, models))


def _check(results, key):
    for r in results:
        res = r[key]
        assert abs(res["loss"] - res["ref"]) <= TOL * abs(res["ref"]), res
        assert res["grad_err"] <= TOL, res


@pytest.mark.parametrize("key", DEFAULT_KEYS)
def test_strategies_equal_the_document_masked_single_device_run(results, key):
    _check(results, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", DEFAULT_KEYS + SLOW_KEYS)
def test_more_strategies_equal_the_document_masked_single_device_run(more_results, key):
    if key not in more_results[0]:
        pytest.skip(f"{key}: run at 4 ranks")
    _check(more_results, key)


@pytest.mark.slow
def test_flex_attention_through_autosp_forward(more_results):
    for r in more_results:
        res = r["packed-flex/autosp"]
        assert abs(res["loss"] - res["ref"]) <= TOL * abs(res["ref"]), res
        assert res["logits_err"] <= TOL, res
    att = more_results[0]["packed-flex/autosp"]["report"]["attention"]
    assert len(att) == 2 and all("FlexAttention block mask" in a["masking"] for a in att)
    assert not more_results[0]["packed-flex/autosp"]["report"]["fallbacks"]


def test_reports_name_the_masking(results):
    ours = results[0]["llama-tiny/autosp"]["report"]
    assert "mask (boolean" in ours
    assert "document masks" in results[0]["llama-tiny/ring"]["report"]


@pytest.mark.slow
def test_reports_name_a_models_own_mask(more_results):
    sdpa = more_results[0]["packed-sdpa/autosp"]["report"]
    assert all(a["masking"].startswith("mask (additive") for a in sdpa["attention"])
    assert not sdpa["fallbacks"]
