"""UPipe's head chunks in the hand-written Ulysses baseline (``--ulysses --attention-head-chunks K``,
``autosp_lm/parallel/upipe.py``): exact, and one chunk's buffers live at a time.

Exactness: loss and every SP-summed gradient against one device in fp32, 1e-5 relative
(``tests/helpers/baseline_parity.py``), eager and compiled (aot_eager in the shared launch;
Inductor under ``-m slow``), with the memory recipe it comes with (``ulysses+upipe``: full
recomputation, chunked loss, tiled MLP, offload), MHA and GQA (kv heads split, chunked, shared
by several chunks, replicated), packed documents; at function level against SDPA in float64. bf16 (eager
here, Inductor ``-m slow``) against the single-device bf16 and fp32 runs with the tolerances of
``tests/training/test_bf16.py`` (justified there, with the negative test that shows they catch a
wrong result).

Memory: one process as rank 0 of a simulated 2-rank group (the planner's fake process group:
the collectives move nothing, every rank allocates what a real one does), :class:`LivePeak`
(exact on CPU) around the attention's forward and backward.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autosp_lm.models.attention import document_mask
from autosp_lm.parallel.upipe import chunks_to_heads, chunks_to_sequence, head_chunked_attention
from tests.helpers.baseline_parity import check_parity
from tests.helpers.launch import Job

PARITY = "tests.helpers.baseline_parity:parity_worker"
AC = dict(recompute_granularity="full", chunked_loss=True)
UPIPE = dict(AC, tiled_mlp=True, tiled_mlp_chunk_tokens=8, cpu_offloading=True,
             attention_head_chunks=0)
L3 = dict(model="llama-tiny", layers=3, seq=64)
H8 = dict(num_attention_heads=8, num_query_groups=4)  # 4 query heads, 2 kv heads a rank at SP 2

U2 = Job(PARITY, ("ulysses", [
    # llama-tiny at SP 2: 2 query heads and 1 kv head a rank, the kv head shared by both chunks
    dict(name="llama chunks 2 (kv shared)", sp=2, options=dict(attention_head_chunks=2),
         positions=True, **L3),
    dict(name="llama 8 heads, chunks 2 (kv chunked)", sp=2, overrides=H8,
         options=dict(attention_head_chunks=2), **L3),
    dict(name="ulysses+upipe", sp=2, options=UPIPE, **L3),
    dict(name="gpt ulysses+upipe", model="gpt-tiny", sp=2, seq=64, options=UPIPE),
    dict(name="ulysses+upipe compiled", sp=2, compile=True, steps=2,
         options=dict(AC, tiled_mlp=True, tiled_mlp_chunk_tokens=8, attention_head_chunks=0),
         model="llama-tiny", layers=1, seq=64),
]))
# head chunks compiled by Inductor (fp32; bf16: BF16_INDUCTOR below), -m slow: ~35 s of a cold
# suite's 2-rank launch
U2_INDUCTOR = Job(PARITY, ("ulysses", [
    dict(name="llama chunks 2 compiled inductor", sp=2, compile=True, steps=2,
         backend="inductor", layers=1, model="llama-tiny", options=dict(attention_head_chunks=2)),
]))
U4 = Job(PARITY, ("ulysses", [
    # 8 query heads, 2 kv heads at SP 4: kv replicated x2, each rank 2 query heads on 1 kv head
    dict(name="llama 8/2 heads sp4 ulysses+upipe", sp=4, overrides=dict(num_attention_heads=8,
                                                                       num_query_groups=2),
         ignore_ranks=(0, 3), options=UPIPE, model="llama-tiny", layers=2, seq=64),
    dict(name="gpt dp2 x sp2 chunks 2", model="gpt-tiny", sp=2, positions=True,
         options=dict(attention_head_chunks=2)),
]))
DOCS = Job("tests.parallel.test_upipe:documents_worker")
# bf16 eager: "ulysses+upipe" in tests/training/test_bf16.py's matrix; on Inductor (-m slow):
BF16_INDUCTOR = ("ulysses", dict(AC, compile=True, tiled_mlp=True, tiled_mlp_chunk_tokens=16,
                                 attention_head_chunks=0))
LAUNCH = {2: [U2, DOCS], 4: [U4]}


# --------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("h, hkv, chunks", [(4, 4, 2), (4, 4, 4), (8, 2, 2), (8, 2, 8),
                                            (8, 4, 2), (8, 4, 8)])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_chunks_equal_sdpa_in_float64(h, hkv, chunks, docs):
    """One rank: every chunk's heads attend exactly as SDPA's (GQA grouping kept), forward and
    backward; kv heads split with the chunks (hkv = 4, 2 chunks) or shared by several."""
    torch.manual_seed(0)
    q = torch.randn(2, h, 24, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, hkv, 24, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    doc = None
    if docs:
        doc = torch.zeros(2, 24, dtype=torch.long)
        doc[:, 7:] += 1
        doc[1, 15:] += 1
    out = head_chunked_attention(q, k, v, chunks=chunks, document_ids=doc)
    ref = (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) if doc is None
           else F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc),
                                               enable_gqa=True))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_exchanges_keep_head_order_and_invert():
    x = torch.arange(2 * 8 * 3 * 2, dtype=torch.float32).view(2, 8, 3, 2)
    parts = chunks_to_sequence(x, 4)
    assert [tuple(p.shape) for p in parts] == [(2, 2, 3, 2)] * 4
    torch.testing.assert_close(parts[1], x[:, 2:4])  # one rank: chunk c is heads [2c, 2c + 2)
    torch.testing.assert_close(chunks_to_heads(parts), x)
    with pytest.raises(ValueError, match=r"do not split into 3 chunks of whole kv heads"):
        head_chunked_attention(x, x[:, :2], x[:, :2], chunks=3)


def _attention_peaks(head_chunks: int, h=8, hkv=8, local=1024, d=64) -> dict:
    """Rank 0 of a simulated SP-2 job, the attention's forward, then its forward and backward,
    under LivePeak; its inputs and the output's gradient made before (the model holds them).
    In units of ``q``: ``left``, what the forward leaves live (what it saves and its output);
    ``forward``, its peak above that; ``backward``, the peak of forward + backward above that
    and above the gradients the backward returns (q, k, v's): the exchange buffers, the
    kernel's outputs and gradients that come and go."""
    import torch.distributed as dist

    from autosp_lm.parallel.ulysses import UlyssesAttention
    from autosp_lm.planner.trace import simulated_world
    from autosp_lm.planner.workspace import reference_kernels
    from autosp_lm.training.memory import LivePeak
    with simulated_world(2), reference_kernels(True):
        attn = UlyssesAttention(dist.group.WORLD, 2, head_chunks=head_chunks)
        q = torch.randn(1, h, local, d, requires_grad=True)
        k, v = (torch.randn(1, hkv, local, d, requires_grad=True) for _ in range(2))
        g = torch.randn(1, h, local, d)
        with LivePeak() as fwd:
            out = attn(q, k, v)
        del out  # (frees what the forward saved)
        with LivePeak() as both:  # the forward again, then its backward
            out = attn(q, k, v)
            out.backward(g)
            del out
    unit = q.numel() * q.element_size()
    return {"left": fwd.end / unit, "forward": (fwd.peak - fwd.end) / unit,
            "backward": (both.peak - fwd.end - both.end) / unit}


@pytest.mark.parametrize("hkv", [8, 4], ids=["mha", "gqa"])
def test_one_chunk_of_buffers_at_a_time(hkv):
    """What the attention allocates and frees again (exchange buffers, the kernel's outputs and
    gradients) with K head chunks is about 1/K of plain Ulysses' (K = 1: the unchunked code
    path), in the forward (above what it saves and returns) and in the backward (above that and
    the gradients it returns); what the forward saves is plain Ulysses' (each chunk's exchanged
    q, k, v and output). Measured (8 heads of 64, 2,048 tokens, SP 2, fp32, one thread; in
    q-sizes of 2 MiB), MHA: forward 2.0 plain, 1.0 at K = 2, 0.25 at K = 4; backward 2.5, 0.5,
    -0.75 (at K = 4 the peak comes before all gradients exist). Unchunked, the bound fails: plain
    Ulysses is checked against it below."""
    plain = _attention_peaks(1, hkv=hkv)
    for K in (2, 4):
        run = _attention_peaks(K, hkv=hkv)
        assert run["left"] == pytest.approx(plain["left"], abs=0.01), (run, plain)
        assert run["forward"] <= 1.25 * plain["forward"] / K, (K, run, plain)
        assert run["backward"] <= 1.25 * plain["backward"] / K, (K, run, plain)
    # the bound discriminates: plain Ulysses' own figures are far above the K = 2 bound
    assert plain["forward"] > 1.25 * plain["forward"] / 2 + 0.5
    assert plain["backward"] > 1.25 * plain["backward"] / 2 + 0.5


# --------------------------------------------------------------------------------- distributed
def test_parity_2_ranks(launch2):
    by_name = check_parity(launch2(U2), 2)
    report = by_name["ulysses+upipe"][0]["report"]
    assert "each rank's heads in 2 chunks, one after the other (UPipe)" in report, report
    assert "full recomputation" in report and "offloaded to host memory" in report
    assert "in 2 chunks" in by_name["llama 8 heads, chunks 2 (kv chunked)"][0]["report"]


@pytest.mark.slow
def test_parity_2_ranks_inductor():
    from tests.helpers.baseline_parity import parity_worker
    from tests.helpers.dist import run_distributed
    check_parity(run_distributed(parity_worker, 2, *U2_INDUCTOR.args), 2)


def test_parity_4_ranks(launch4):
    results = check_parity(launch4(U4), 4)
    report = results["llama 8/2 heads sp4 ulysses+upipe"][0]["report"]
    assert "kv heads replicated x2" in report and "in 2 chunks" in report, report


def documents_worker(rank, world):
    """Packed documents (--reset-attention-mask) through --ulysses with head chunks against
    the document-masked single-device run (tests/parallel/test_document_masking.py's batch)."""
    import numpy as np

    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel.grads import reduce_gradients
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy
    from tests.parallel.test_document_masking import one_device_step
    torch.set_num_threads(1)
    cfg = preset_config("llama-tiny", num_layers=1, **H8)
    batch, ref_model, ref = one_device_step(cfg)
    out = {}
    for chunks in (2, 0):
        ps = init_parallel(world)
        torch.manual_seed(0)
        model = build_model(cfg)
        strategy = build_strategy("ulysses", ps, attention_head_chunks=chunks)
        strategy.setup(model)
        loss, reported = strategy.forward_loss(batch)
        loss.backward()
        reduce_gradients(model.parameters(), ps.dp_size)
        err = max(float(np.linalg.norm((p.grad - q.grad).numpy())
                        / np.linalg.norm(q.grad.numpy()))
                  for p, q in zip(model.parameters(), ref_model.parameters()))
        out[chunks] = dict(loss=reported.item(), ref=ref.item(), grad_err=err)
    return out


def test_packed_documents_2_ranks(launch2):
    for r in launch2(DOCS):
        for chunks, res in r.items():
            assert abs(res["loss"] - res["ref"]) <= 1e-5 * abs(res["ref"]), (chunks, res)
            assert res["grad_err"] <= 1e-5, (chunks, res)


# --------------------------------------------------------------------------------- errors
def test_flags_are_checked_before_any_work():
    from autosp_lm.models import preset_config
    from autosp_lm.parallel import ParallelState
    from autosp_lm.strategies.ulysses import UlyssesOptions, UlyssesStrategy
    cfg = preset_config("llama-tiny")  # 4 query heads, 2 kv heads
    UlyssesStrategy.check(cfg, 2, 64, UlyssesOptions(attention_head_chunks=0))
    with pytest.raises(ValueError, match=r"--ulysses: --attention-head-chunks 4 does not split "
                                         r"each rank's 2 query heads \(4 heads over 2 ranks\).*"
                                         r"use one of 1, 2 \(0: 2"):
        UlyssesStrategy.check(cfg, 2, 64, UlyssesOptions(attention_head_chunks=4))
    with pytest.raises(ValueError, match="the 2-D hybrid, which has no head chunks"):
        UlyssesStrategy.check(cfg, 4, 64, UlyssesOptions(attention_head_chunks=2,
                                                         ulysses_degree=2))
    with pytest.raises(ValueError, match="the 2-D hybrid, which has no head chunks"):
        UlyssesStrategy(ParallelState(sp_size=4, world_size=4), attention_head_chunks=2,
                        ulysses_degree=2)
    with pytest.raises(ValueError, match=r"--attention-head-chunks must be >= 0"):
        UlyssesOptions(attention_head_chunks=-1)


def bf16_worker(rank, world):
    """The bf16 matrix's references (tests/training/test_bf16.py) and UPipe's recipe compiled
    on Inductor under Megatron-style bf16, one step of a 1-layer llama-tiny on 2 ranks."""
    from autosp_lm.models import preset_config
    from autosp_lm.parallel.precision import cast_parameters
    from tests.training import test_bf16 as B
    torch.set_num_threads(1)
    cfg = preset_config(B.MODEL, num_layers=B.LAYERS)
    batch = B.make_batch(B.SEQ, cfg.vocab_size)
    out = {}
    for key, bf16 in (("ref-fp32", False), ("ref-bf16", True)):
        model = B._model(cfg)
        if bf16:
            cast_parameters(model, torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(batch["input_ids"], position_ids=batch["position_ids"],
                         labels=batch["labels"])
        loss.backward()
        out[key] = {"loss": loss.item(), "grads": B._grads(model)}
    name, options = BF16_INDUCTOR
    out["upipe"] = B._step(rank, world, cfg, name, options, batch)
    return out


@pytest.mark.slow  # an Inductor compile of the recipe in bf16 (~30 s on 2 busy cores)
def test_bf16_inductor_equals_single_device():
    """With the bf16 matrix's tolerances (4u of the one-device bf16 run, 8u of the fp32 one;
    justified in tests/training/test_bf16.py, whose negative test shows they catch a wrong
    result)."""
    from tests.helpers.dist import run_distributed
    from tests.training import test_bf16 as B
    per_rank = run_distributed(bf16_worker, 2)
    assert per_rank[0]["upipe"]["loss"] == per_rank[1]["upipe"]["loss"]
    res = per_rank[0]
    assert "in 2 chunks" in res["upipe"]["report"], res["upipe"]["report"]
    assert not B.mismatches(res["upipe"], res["ref-bf16"], B.GRAD_TOL_BF16, B.LOSS_TOL_BF16)
    assert not B.mismatches(res["upipe"], res["ref-fp32"], B.GRAD_TOL_FP32, B.LOSS_TOL_FP32)
