"""AutoSP on whole model families written unlike ours: a Mamba-2-style chunked scan
(tests/helpers/decoders/ssd_style.py) and scans over whole blocks, a gated delta rule
(delta_style.py), a sequence classifier with a pooled loss, a decoder without attention, and
research code on flattened tokens or with torch's associative_scan. Parity as in test_autosp.py
(loss and every summed gradient within 1e-5 of one device); the report shows what runs
head-parallel and that nothing is gathered. All under -m slow (the gated delta rule alone costs a
cold 2-rank run ~57 CPU s, torch's symbolic shapes of its loop over chunks); the default suite's
scans are test_autosp_generality.py's scan case.
Split from test_autosp_generality.py, which runs one decoder per class of model code."""
from __future__ import annotations

import pytest

from tests.helpers import autosp_cases as C
from tests.helpers.dist import run_distributed
from tests.helpers.decoders.delta_style import DeltaNet
from tests.helpers.decoders.ssd_style import BlockScan, ChunkedSSD
from tests.helpers.launch import Job, SharedLaunch, job_worker


class FlatTokens(__import__("torch").nn.Module):
    """Research code that works on the batch and the sequence flattened into one token dim: the
    attention output, flattened, is sub-sampled on its features (``t[:, ::2]``, a step that is
    not on the sequence), and the loss adds a term on the first rows of the flattened tokens
    (``t[:rows]``: part of a dimension that merges the batch with the sequence). ``peel``: the
    attention output is split into the sequence and a tail of ``keep`` = 0 positions handled one
    at a time (as transformers' Qwen3-Next does with the recurrent states it keeps), then joined
    again."""

    def __init__(self, rows=0, peel=False):
        import torch
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.qkv, self.o = torch.nn.Linear(32, 96), torch.nn.Linear(16, 32)
        self.head, self.rows, self.peel = torch.nn.Linear(32, 64), rows, peel

    def forward(self, input_ids, labels):
        import torch.nn.functional as F
        b, s = input_ids.shape
        x = self.emb(input_ids)
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, s, 3, 2, 16).unbind(2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        if self.peel:
            import torch
            keep = 0
            main, tail = torch.tensor_split(a, [s - keep], dim=1)
            a = torch.cat([main] + [tail[:, i:i + 1] * 2 for i in range(keep)], dim=1)
        t = a.reshape(b * s, 32)
        x = x + self.o(t[:, ::2]).view(b, s, 32)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return loss + t[:self.rows].square().mean() if self.rows else loss


def flat_tokens_worker(rank, world):
    """{rows: (loss, one-device loss, max relative gradient error, [(op, reason) fallbacks]) or
    the error it raised}."""
    import torch
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for rows in (0, 4, "peel"):
        model = FlatTokens(0, peel=True) if rows == "peel" else FlatTokens(rows)
        res = C.against_one_device(model, ids)
        out[rows] = res if isinstance(res, str) else (
            res[0], res[1], res[2], [(f["op"], f["reason"]) for f in res[3]["fallbacks"]],
            res[3]["collectives_forward"])
    return out


def scan_hop_worker(rank, world):
    """A gated linear recurrence h_t = a_t * h_(t-1) + x_t written with torch's
    ``associative_scan`` (Jamba-style research code), after an attention: the error AutoSP
    raises (None if it compiled)."""
    import torch
    import torch.nn.functional as F
    from torch._higher_order_ops.associative_scan import associative_scan
    from autosp_lm.compiler import autosp_compile

    def combine(x, y):
        return x[0] * y[0], x[1] * y[0] + y[1]

    class GatedScan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.gate = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32)
            self.qkv, self.head = torch.nn.Linear(32, 96), torch.nn.Linear(32, 64)

        def forward(self, input_ids, labels):
            b, s = input_ids.shape
            x = self.emb(input_ids)
            q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, s, 3, 2, 16).unbind(2))
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) \
                .reshape(b, s, 32)
            _, h = associative_scan(combine, (torch.sigmoid(self.gate(x)), x), dim=1,
                                    combine_mode="generic")
            x = x + h
            return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

    torch._dynamo.reset()
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    try:
        autosp_compile(GatedScan(), backend="aot_eager", verbose=False)(
            input_ids=ids, labels=torch.roll(ids, -1, 1))
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return f"{type(e).__name__}: {e}"
    return None


class ConvScanLM(__import__("torch").nn.Module):
    """A decoder without attention, in the manner of state-space / long-convolution models: per
    layer a causal depthwise convolution (``conv1d`` of ``F.pad(x, (k - 1, 0))``), a gated input,
    and a running mean of it over the sequence (``cumsum`` over positions divided by ``1..S``)."""

    def __init__(self, dim=32, layers=2, k=4, vocab=64):
        import torch
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.k = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab), k
        self.convs = torch.nn.ModuleList(torch.nn.Conv1d(dim, dim, k, groups=dim) for _ in range(layers))
        self.gates = torch.nn.ModuleList(torch.nn.Linear(dim, 2 * dim) for _ in range(layers))

    def forward(self, input_ids, labels):
        import torch
        import torch.nn.functional as F
        x = self.emb(input_ids)
        steps = torch.arange(1, input_ids.shape[1] + 1, device=x.device).view(1, -1, 1)
        for conv, gate in zip(self.convs, self.gates):
            h = conv(F.pad(x.transpose(1, 2), (self.k - 1, 0))).transpose(1, 2)
            a, g = gate(F.silu(h)).chunk(2, dim=-1)
            x = x + torch.cumsum(a * torch.sigmoid(g), dim=1) / steps
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def no_attention_worker(rank, world):
    """:func:`~tests.helpers.autosp_cases.against_one_device` of ConvScanLM at SP 2."""
    import torch
    return C.against_one_device(ConvScanLM(), torch.randint(
        0, 64, (2, 32), generator=torch.Generator().manual_seed(1)))


class PooledClassifier(__import__("torch").nn.Module):
    """A sequence classifier: a causal attention layer, then log-sum-exp pooling over the
    sequence (no AutoSP rule: the pooled vector is computed on the gathered sequence, the same on
    every rank) and a loss on the pooled vector, so the loss itself is replicated."""

    def __init__(self, vocab=64, dim=32, classes=5):
        import torch
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.qkv = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, 3 * dim)
        self.cls = torch.nn.Linear(dim, classes)

    def forward(self, input_ids, labels):
        import torch
        import torch.nn.functional as F
        b, s = input_ids.shape
        x = self.emb(input_ids)
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, s, 3, 2, 16).unbind(2))
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        pooled = torch.logsumexp(x, dim=1)
        return F.cross_entropy(self.cls(pooled), labels[:, 0].remainder(5).detach())


def chunked_ssd_worker(rank, world, padded=True, block_scan=True, ssd=True):
    """The chunked-scan models at this group's size: {"delta": against_one_device of DeltaNet,
    with ``ssd`` (the default launch leaves them to -m slow, ~50 CPU s) "step": of ChunkedSSD,
    "bad": the error of a later call (the step's runner) whose length the chunks divide but the
    ranks' blocks do not, "pooled": of PooledClassifier; "padded": the same of ChunkedSSD's padded
    variant (with ``padded``: -m slow, ~40 CPU s), "block_scan": of BlockScan (with
    ``block_scan``: -m slow too)}."""
    import torch
    ids = torch.randint(0, 64, (2, 8 * world), generator=torch.Generator().manual_seed(1))
    out = {"delta": C.against_one_device(DeltaNet(chunk=8, attention=False), ids)}
    if ssd:
        runners = []
        out["step"] = C.against_one_device(ChunkedSSD(), ids, runners)
        out["pooled"] = C.against_one_device(PooledClassifier(), ids)
        bad = torch.randint(0, 64, (2, 4 * world + 4))  # a multiple of the chunk, not chunk x P
        try:
            runners[0](input_ids=bad, labels=bad)
            out["bad"] = None
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            out["bad"] = f"{type(e).__name__}: {e}"
    if block_scan:
        out["block_scan"] = C.against_one_device(BlockScan(), ids)
    if padded:
        out["padded"] = C.against_one_device(ChunkedSSD(pad=True), ids)
    return out


NO_ATTENTION = Job("tests.compiler.test_autosp_generality_families:no_attention_worker")
FLAT_TOKENS = Job("tests.compiler.test_autosp_generality_families:flat_tokens_worker")
SCAN_HOP = Job("tests.compiler.test_autosp_generality_families:scan_hop_worker")
# -m slow: one 2-rank launch of their own (a model without attention by default: test_autosp.py's
# test_a_model_without_attention_is_planned)
SLOW_JOBS = [FLAT_TOKENS, SCAN_HOP, NO_ATTENTION]


@pytest.fixture(scope="module")
def slow_jobs():
    """The slow jobs' results, read as the shared launch's: ``slow_jobs(job)`` -> by rank."""
    return SharedLaunch(2, SLOW_JOBS, run_distributed(job_worker, 2, SLOW_JOBS))


@pytest.fixture(scope="module")
def ssd_full():
    """chunked_ssd_worker with every model (the chunked scan, the pooled classifier, the padded
    scan and the scans over blocks too)."""
    return run_distributed(chunked_ssd_worker, 2)


@pytest.mark.slow
def test_flattened_tokens_sliced_on_features_need_no_gather(slow_jobs):
    """A step on the features of a flattened batch x sequence dim is not a cut of the sequence:
    planned locally, exact, no fallback. A part of the flattened dim falls back, named by its
    cause (not "a slice of the sequence with a step") and its fix, and stays exact: the rows are
    the same on every rank and their gradient is counted once (they were refused before)."""
    for res in slow_jobs(FLAT_TOKENS):
        loss, ref, err, fallbacks, _ = res[0]
        assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
        assert fallbacks == []
        loss, ref, err, fallbacks, _ = res[4]
        assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
        (reason,) = [r for op, r in fallbacks if op == "getitem"]
        assert "merges the batch with the sequence" in reason and "Fix: index before merging " \
            "them" in reason and "with a step" not in reason, reason
        assert "gradient is scaled by 1/P" in reason, reason


@pytest.mark.slow  # scans by default: test_parity_2_ranks[scan]
def test_scan_with_a_fixed_length_is_refused_with_a_fix_that_fits_a_scan(slow_jobs):
    """torch's associative_scan returns a fixed length, so the traced sequence length becomes a
    constant: the refusal says so, at the model line where it happened, and its fix is a scan
    AutoSP shards (not "pass input_ids by name", which the call did)."""
    for msg in slow_jobs(SCAN_HOP):
        assert msg and msg.startswith("AutoSPError: AutoSP: the sequence length of input "
                                      "input_ids became the constant 32"), msg
        assert "`x = x + h`" in msg and "test_autosp_generality_families.py" in msg, msg
        assert "cumsum" in msg and "logcumsumexp" in msg and "by name" not in msg, msg


@pytest.mark.slow
def test_split_off_an_empty_tail_of_the_sequence_needs_no_gather(slow_jobs):
    """``tensor_split(x, [S - keep], dim=seq)`` with ``keep`` = 0 (the whole sequence and an empty
    tail, Qwen3-Next's split before its chunked delta rule): the whole piece keeps its layout,
    exact, no fallback, no gather; before, the split fell back and was refused."""
    for res in slow_jobs(FLAT_TOKENS):
        loss, ref, err, fallbacks, collectives = res["peel"]
        assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
        assert fallbacks == [] and "all_gather" not in collectives, (fallbacks, collectives)


@pytest.mark.slow
def test_a_decoder_without_attention_is_planned_without_gathers(slow_jobs):
    """A convolution + scan decoder with no attention (issue 35: a pure state-space model was
    refused with "found no attention"): planned, exact, its mixing by the halo exchange and the
    exclusive scan, no gather, no all-to-all, and the report says why there is none."""
    for loss, ref, err, report in slow_jobs(NO_ATTENTION):
        assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
        assert not report["fallbacks"], report["fallbacks"]
        fwd = report["collectives_forward"]
        assert "all_gather" not in fwd and "all_to_all" not in fwd, fwd
        assert fwd.get("seq_window") and fwd.get("exclusive_scan"), fwd
        assert any(note.startswith("no attention in the model") for note in report["notes"])


def _check_chunked_ssd(res, world):
    loss, ref, err, report = res["step"]
    assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
    # nothing is gathered: the recurrence across chunks (the zero state put first, the chunks'
    # total decays padded, their segment sums and the states passed on) runs head-parallel, the
    # whole sequence of chunk-level values for 1/P of the heads, between all-to-alls
    fwd = report["collectives_forward"]
    assert set(fwd) == {"all_to_all", "all_reduce_loss"} and not report["fallbacks"], report
    regions = [r for r in report["regions"] if r["entry"]]
    assert regions and all((r["split"], r["per_rank"]) == (4, 4 // world) for r in regions), \
        regions
    assert {"cumsum", "einsum"} <= {op for r in regions for op in r["ops"]}, regions
    assert report["length_multiple"] == 4 * world
    assert any("sequence cut into blocks of 4" in w["how"] for w in report["rewrites"])
    per_token = [f for f in report["fallbacks"] if "bcl" in f["description"]]  # bclhn, bclhp
    assert not per_token, per_token
    bad = res["bad"]
    assert bad and bad.startswith("AutoSPError") and f"not a multiple of {4 * world}" in bad \
        and "hold whole" in bad, bad


@pytest.mark.slow  # ssd_full's 2-rank launch; scans by default: test_autosp_generality.py's
# test_parity_2_ranks[scan]
def test_chunked_state_space_scan_keeps_the_chunks_sharded(ssd_full):
    """A Mamba-2-style chunked scan (issue 35): the cut into chunks keeps the sequence sharded
    (each rank holds whole chunks), the intra-chunk einsums run locally, and the recurrence
    across chunks runs head-parallel: exact, no gather (there were 5 of per-token values, then 2
    of chunk-level values), with the length multiple stated in the report and a call that
    breaks it refused by name."""
    for res in ssd_full:
        _check_chunked_ssd(res, 2)


@pytest.mark.slow  # ssd_full's 2-rank launch (~150 CPU s)
def test_a_padding_to_a_multiple_of_the_chunk_is_planned_as_none(ssd_full):
    """The same scan with its inputs padded to a multiple of the chunk (``(c - S % c) % c``
    rows, transformers' Mamba-2): the traced length is a multiple, so the padding is planned as
    0 rows and the cut into chunks stays sharded; the report's length multiple covers it."""
    for res in ssd_full:
        loss, ref, err, report = res["padded"]
        assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
        assert set(report["collectives_forward"]) == {"all_to_all", "all_reduce_loss"}, report
        assert report["length_multiple"] == 8, report["length_multiple"]
        assert not [f for f in report["fallbacks"] if f["reason"].startswith("pad of the")], \
            report["fallbacks"]


@pytest.mark.slow  # scans by default: test_parity_2_ranks[scan]
def test_scans_over_whole_blocks(ssd_full):
    """A running sum over blocks is the exclusive scan over the ranks, with no gather; a running
    max, whose indices count positions, has no sharding rule and runs head-parallel (named with
    that cause), and both stay exact."""
    for res in ssd_full:
        loss, ref, err, report = res["block_scan"]
        assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
        assert report["collectives_forward"].get("exclusive_scan") == 1, report
        assert not report["fallbacks"], report["fallbacks"]
        (region,) = [r for r in report["regions"] if r["entry"]]
        assert region["op"] == "cummax" and "cut into blocks" in region["entry"], region


@pytest.mark.slow  # ssd_full's 2-rank launch; a reduction over the whole sequence run
# head-parallel by default: test_autosp_generality.py's test_cuts_fall_back_with_cause_and_fix
def test_a_loss_computed_on_the_gathered_sequence_counts_once(ssd_full):
    """A loss that no rule splits (log-sum-exp pooling over the sequence, then a classifier) is
    the same on every rank: each rank's backward counts 1/P of it, so the summed gradients are
    one device's (they were P times too large) and it is planned, not refused. The pooling runs
    head-parallel (features split) and its result is gathered over them: replicated."""
    for res in ssd_full:
        loss, ref, err, report = res["pooled"]
        assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
        assert any("logsumexp" in r["ops"] for r in report["regions"] if r["entry"]), report


def _check_delta(res, world):
    loss, ref, err, report = res["delta"]
    assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, (loss, ref, err)
    fwd = report["collectives_forward"]
    assert set(fwd) == {"all_to_all", "all_reduce_loss"} and not report["fallbacks"], report
    regions = [r for r in report["regions"] if r["entry"]]
    assert all((r["split"], r["per_rank"]) == (4, 4 // world) for r in regions), regions
    assert "setitem" in {op for r in regions for op in [r["op"]] + r["ops"]}, regions


@pytest.mark.slow  # ssd_full's 2-rank launch: ~57 CPU s for this model alone, cold, on 2 ranks.
# The cost is torch's symbolic shapes, not AutoSP: the loop over chunks pins S // chunk, and
# plain torch.compile(dynamic=True) of this model takes 44 CPU s against 5 with static shapes.
def test_gated_delta_rule_runs_head_parallel(ssd_full):
    """A gated delta rule (Gated DeltaNet's linear attention): the intra-chunk UT transform (a
    triangular solve per chunk) stays local on the rank's chunks; the loop over chunks, which
    carries a state and writes each chunk's output in place, runs head-parallel (the whole
    sequence for 1/P of the heads). Exact, no gather, no fallback. Writing in place into a
    converted copy (gathered or all-to-all'ed) redefines the value: before, the writes were
    lost and the gradients silently wrong."""
    for res in ssd_full:
        _check_delta(res, 2)


@pytest.mark.slow  # four ranks compiling several models: ~90 s
def test_chunked_state_space_scan_at_sp4():
    for res in run_distributed(chunked_ssd_worker, 4):
        _check_chunked_ssd(res, 4)
        _check_delta(res, 4)
        assert res["pooled"][2] <= 1e-5, res["pooled"][:3]


@pytest.mark.slow  # two Inductor compiles per case: 2 ranks ~3 min, 4 ranks longer
@pytest.mark.parametrize("which,world", [("ssd", 2), ("delta", 2), ("ssd", 4), ("delta", 4)])
def test_chunked_scans_on_inductor_fp32_and_bf16(which, world):
    """The chunked scan and the gated delta rule on the default backend: fp32 within 1e-5 of one
    device, bf16 autocast within the bounds of tests/training/test_bf16.py (4u of the one-device
    bf16 run, or 2u plus that run's own error from fp32; 8u of fp32); no gather, no fallback."""
    from tests.training.test_bf16 import GRAD_TOL_BF16, GRAD_TOL_FP32, LOSS_TOL_BF16
    u = GRAD_TOL_BF16 / 4
    for res in run_distributed(C.chunked_ssd_inductor_worker, world, which, timeout=3000):
        loss, ref, _, err, _, _, fwd, fallbacks = res[False]
        assert abs(loss - ref) <= 1e-5 * abs(ref) and max(err.values()) <= 1e-5, (loss, ref, err)
        assert "all_gather" not in fwd and fwd["all_to_all"] >= 2 and not fallbacks, fwd
        loss, ref, fp32_loss, err, err32, ref32, fwd, fallbacks = res[True]
        assert abs(loss - ref) <= LOSS_TOL_BF16 * abs(ref), (loss, ref)
        assert not {n: e for n, e in err.items() if e > max(GRAD_TOL_BF16, 2 * u + ref32[n])}
        assert not {n: e for n, e in err32.items() if e > GRAD_TOL_FP32}, err32
        assert "all_gather" not in fwd and not fallbacks, fwd
