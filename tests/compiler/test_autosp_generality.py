"""AutoSP on model code written unlike ours (tests/helpers/decoders/): short-range mixing by a
halo exchange, hand-written attention as a region, scans, token-routed MoE, first-call graph
breaks. Parity as in test_autosp.py (loss and every summed gradient within 1e-5 of one device,
the same loss on every rank), and the report shows no gather for these classes: no fallback, no
all_gather of the sequence (the scan case gathers only the per-rank totals of cummax). The
default suite runs one case per class, the cuts' fallbacks, the chunked scan, the gated delta rule
and the pooled classifier at SP 2; more spellings, the ring plan's fallbacks, other research code
(flattened tokens, associative_scan, no attention, scans over blocks), SP 4 and Inductor under
-m slow."""
from __future__ import annotations

import pytest

from tests.helpers import autosp_cases as C
from tests.helpers.dist import run_distributed
from tests.helpers.decoders.delta_style import DeltaNet
from tests.helpers.decoders.ssd_style import BlockScan, ChunkedSSD
from tests.helpers.launch import Job, SharedLaunch, job_worker


def _case(model, backend="aot_eager", ulysses_degree=0, bf16=False, **opts):
    return C.Case(model, layers=1, opts=tuple(opts.items()), backend=backend,
                  ulysses_degree=ulysses_degree, bf16=bf16)


# class of model code -> the report class its rewrites are listed under
CLASS = {"hooks": "graph breaks", "mixing": "short-range mixing", "einsum": "attention region", "moe": "token routing",
         "scan": "scans"}
# a ring plan (U = 1, R = 2 at SP 2: the zigzag layout): halo, scans and regions fall back
RING_CASES = [_case("mixing", shift="pad", conv="pad", ulysses_degree=1),
              _case("scan", ulysses_degree=1), _case("einsum", ulysses_degree=1)]
BINCOUNT = _case("moe", counts="bincount")  # no rule: a named fallback
BF16_DEFAULT = _case("einsum", backend="inductor", bf16=True)  # the cheap bf16 representative
LOCK = _case("hooks", lock=True)  # a first-call break under a lock (transformers 5)
P2_CASES = [  # the default suite (the shared launch): one case per class
    _case("mixing", shift="pad", conv="pad"),         # F.pad shift, conv1d(F.pad(x, (k-1, 0)))
    _case("einsum"),                                  # einsum scores, T5 bias, softcap, tril
    _case("moe"),                                     # argsort, index_add back, histc counts
    _case("scan"),                                    # cumsum, cumprod, logcumsumexp, cummax
    _case("hooks"),                                   # a forward hook installed on call 1
    _case("hooks", every_call=True),                  # ... on every call: a clear refusal
    _case("cut"),                                     # x[:, :S//2], x[:, ::4]: named fallbacks
]
# -m slow, with the default cases' checks: more spellings of the region and routing classes
MOVED_P2_CASES = [
    _case("einsum", style="matmul", kv_heads=2, sinks=True),  # GPT-OSS sinks: cat, softmax, [..., :-1]
    _case("moe", back="inverse", experts_impl="grouped"),  # sort, histc offsets, grouped kernel
]
# -m slow, each read by its own test: the ring plan's fallbacks, bincount's, the lock's break
OTHER_SLOW_P2_CASES = RING_CASES + [BINCOUNT, LOCK]
SLOW_P2_CASES = [
    _case("mixing"),                                  # cat-of-slices shift, conv1d(pad)[..., :S]
    _case("mixing", shift="roll", dilation=2),        # roll + masked row 0, dilated conv
    _case("einsum", style="matmul", kv_heads=2),      # q @ k^T, GQA, ALiBi, sliding window
    _case("einsum", style="bmm"),                     # heads merged into the batch, triu mask
    _case("moe", back="argsort"),                     # y[argsort(perm)]
]
SLOW_P4_CASES = [_case("mixing", shift="slices"),     # zeros_like(x[:, :1]) + x[:, :-1] shift
                 _case("moe", back="inverse", counts="scatter"),  # inv[perm] = arange, scatter_add
                 _case("einsum", style="matmul", kv_heads=2), _case("scan"),
                 _case("mixing", shift="pad", conv="pad")]
# the default backend, fp32 and bf16 autocast, every class (one launch)
INDUCTOR_CASES = [_case(m, backend="inductor", bf16=bf16) for bf16 in (False, True)
                  for m in ("mixing", "einsum", "moe", "scan", "hooks")
                  if _case(m, backend="inductor", bf16=bf16) != BF16_DEFAULT] + [BF16_DEFAULT]


def _check_report(res, case):
    report = res["report"]
    assert not report["fallbacks"], res["text"]
    fwd = report["collectives_forward"]
    if case.model != "scan":
        assert "all_gather" not in fwd, res["text"]
    cls = CLASS[case.model]
    assert report["by_class"][cls]["rewritten"], res["text"]
    assert not any(v["fallbacks"] for v in report["by_class"].values()), res["text"]
    return report


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


def chunked_ssd_worker(rank, world, padded=True, block_scan=True):
    """ChunkedSSD at this group's size: {"step": against_one_device, "padded": the same of its
    padded variant (with ``padded``: the default launch leaves it to -m slow, ~40 CPU s), "bad":
    the error of a later call (the step's runner) whose length the chunks divide but the ranks'
    blocks do not, "pooled": against_one_device of PooledClassifier, "delta": of DeltaNet,
    "block_scan": of BlockScan (with ``block_scan``: -m slow too)}."""
    import torch
    ids = torch.randint(0, 64, (2, 8 * world), generator=torch.Generator().manual_seed(1))
    runners = []
    out = {"step": C.against_one_device(ChunkedSSD(), ids, runners),
           "pooled": C.against_one_device(PooledClassifier(), ids),
           "delta": C.against_one_device(DeltaNet(chunk=8, attention=False), ids)}
    if block_scan:
        out["block_scan"] = C.against_one_device(BlockScan(), ids)
    if padded:
        out["padded"] = C.against_one_device(ChunkedSSD(pad=True), ids)
    run = runners[0]
    bad = torch.randint(0, 64, (2, 4 * world + 4))  # a multiple of the chunk, not of chunk x P
    try:
        run(input_ids=bad, labels=bad)
        out["bad"] = None
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        out["bad"] = f"{type(e).__name__}: {e}"
    return out


NO_ATTENTION = Job("tests.compiler.test_autosp_generality:no_attention_worker")
FLAT_TOKENS = Job("tests.compiler.test_autosp_generality:flat_tokens_worker")
SCAN_HOP = Job("tests.compiler.test_autosp_generality:scan_hop_worker")
# the chunked scan, the gated delta rule and the pooled classifier (the padded scan and the
# scans over whole blocks: -m slow, ssd_full)
CHUNKED_SSD = Job("tests.compiler.test_autosp_generality:chunked_ssd_worker", (False, False))
# the default suite's cases run in the session's shared launch (tests/helpers/launch.py)
LAUNCH = {2: P2_CASES + [CHUNKED_SSD]}
# -m slow: one 2-rank launch of their own (a model without attention by default: test_autosp.py's
# test_a_model_without_attention_is_planned)
SLOW_JOBS = [FLAT_TOKENS, SCAN_HOP, NO_ATTENTION]


@pytest.fixture(scope="module")
def p2_results(launch2):
    return launch2.per_rank


@pytest.fixture(scope="module")
def slow_jobs():
    """The slow jobs' results, read as the shared launch's: ``slow_jobs(job)`` -> by rank."""
    return SharedLaunch(2, SLOW_JOBS, run_distributed(job_worker, 2, SLOW_JOBS))


@pytest.fixture(scope="module")
def ssd_full():
    """chunked_ssd_worker with every model (the padded scan and the scans over blocks too)."""
    return run_distributed(chunked_ssd_worker, 2)


@pytest.fixture(scope="module")
def p2_slow_results():
    return run_distributed(C.worker, 2, SLOW_P2_CASES + MOVED_P2_CASES + OTHER_SLOW_P2_CASES)


PARITY_P2 = [c for c in P2_CASES if c.model in CLASS and c.model != "hooks"]


@pytest.mark.parametrize("case", PARITY_P2, ids=lambda c: c.id)
def test_parity_2_ranks(p2_results, case):
    _check_parity_2(p2_results, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MOVED_P2_CASES, ids=lambda c: c.id)
def test_parity_2_ranks_moved(p2_slow_results, case):
    _check_parity_2(p2_slow_results, case)


def _check_parity_2(results, case):
    res = C.check_parity(results, case)
    report = _check_report(res, case)
    fwd = report["collectives_forward"]
    if case.model == "mixing":  # the halo exchange replaces any gather
        assert fwd.get("seq_window", 0) >= 2 and report["collectives_backward"].get(
            "seq_window_backward", 0) >= 2, res["text"]
    if case.model == "einsum":  # per region: q, k, v in and the output out, as for SDPA
        assert len(report["regions"]) == 1 and fwd["all_to_all"] >= 4, res["text"]
    if dict(case.opts).get("sinks"):  # the sink column joins and leaves inside the region
        assert {"cat", "softmax", "getitem", "matmul"} <= set(report["regions"][0]["ops"]), \
            res["text"]
        assert report["regions"][0]["per_rank"] * 2 == report["regions"][0]["split"]
    if case.model == "moe":  # counts of the aux loss: one small all_reduce_sum each
        assert fwd.get("all_reduce_sum", 0) >= 1, res["text"]
    if case.model == "scan":
        assert fwd.get("exclusive_scan", 0) >= 4, res["text"]


def test_report_lists_classes(p2_results):
    res = p2_results[0][_case("mixing", shift="pad", conv="pad")]
    assert "per class (rewritten / fallbacks):" in res["text"]
    assert "short-range mixing:" in res["text"] and "slices:" in res["text"], res["text"]
    res = p2_results[0][_case("einsum")]
    assert "hand-written attention regions (1)" in res["text"], res["text"]
    ops = res["report"]["regions"][0]["ops"]
    assert {"einsum", "tanh", "masked_fill", "softmax"} <= set(ops), ops


@pytest.mark.slow
def test_parity_more_spellings(p2_slow_results):
    for results, cases in ((p2_slow_results, SLOW_P2_CASES),
                           (run_distributed(C.worker, 4, SLOW_P4_CASES), SLOW_P4_CASES)):
        for case in cases:
            _check_report(C.check_parity(results, case), case)


@pytest.fixture(scope="module")
def inductor_results():
    return run_distributed(C.worker, 2, INDUCTOR_CASES, timeout=3600)


@pytest.mark.slow
@pytest.mark.parametrize("case", INDUCTOR_CASES, ids=lambda c: c.id)
def test_parity_inductor(inductor_results, case):
    res = C.check_parity(inductor_results, case)  # the bf16 bounds for a bf16 case
    _check_report(res, case)


@pytest.mark.slow  # one Inductor compile under autocast: ~100 s; bf16 on Inductor through AutoSP
# runs in the default suite in tests/training/test_bf16.py
def test_bf16_default_backend(inductor_results):
    """The bf16 representative on Inductor, the hand-written region (the other classes:
    test_parity_inductor)."""
    _check_report(C.check_parity(inductor_results, BF16_DEFAULT), BF16_DEFAULT)


@pytest.mark.slow  # the ring plan by default: tests/compiler/test_autosp_2d.py
@pytest.mark.parametrize("case", RING_CASES[:2], ids=lambda c: c.id)
def test_ring_plan_falls_back_exactly(p2_slow_results, case):
    """Under a ring plan (U x R = 1 x 2, zigzag layout) the halo exchange and the scans fall
    back: exact, each fallback naming the cause and the fix."""
    res = C.check_parity(p2_slow_results, case)
    assert res["report"]["plan"]["ring_degree"] == 2, res["text"]
    named = [f for f in res["report"]["fallbacks"] if "contiguous and in rank order" in f["reason"]]
    assert named, res["text"]
    for f in named:
        assert "use --ulysses-degree equal to the sequence-parallel size" in f["reason"], f
    assert any(f["cls"] == CLASS[case.model] for f in named), named


@pytest.mark.slow
def test_ring_plan_refuses_a_hand_written_region(p2_slow_results):
    """A model whose only attention is hand-written, under a ring plan: nothing would be split,
    so a refusal that names the region, the ring degree and the fix."""
    err = p2_slow_results[0][RING_CASES[2]]["error"]
    for needle in ("AutoSPError", "only attention is hand-written", "einsum_style.py:",
                   "ring degree (R = 2)", "Fix: --ulysses-degree equal to the sequence-parallel"):
        assert needle in err, err


@pytest.mark.slow  # a named fallback by default: test_cuts_fall_back_with_cause_and_fix
def test_bincount_falls_back_with_the_fix(p2_slow_results):
    """bincount (data-dependent length) is captured in the graph but has no rule: exact through
    the fallback, which names the spellings that take the routing plan."""
    res = C.check_parity(p2_slow_results, BINCOUNT)
    (f,) = res["report"]["fallbacks"]
    assert f["op"] == "bincount" and "Fix: count with torch.histc" in f["reason"], f


def test_first_call_hooks(p2_results):
    """Hooks installed on the first call: one safe eager call, then the whole graph; exact."""
    case = _case("hooks")
    res = C.check_parity(p2_results, case)
    _check_report(res, case)
    (brk,) = res["report"]["graph_breaks"]
    assert "hooks_style.py:" in brk and "register_forward_hook" in brk, brk
    assert "one eager call" in brk and "__init__" in brk, brk
    assert "first-call graph break: hooks installed" in res["text"]


@pytest.mark.slow  # a first-call break by default: test_first_call_hooks
def test_first_call_break_at_a_lock(p2_slow_results):
    """A first-call break that is not a hook registration (the lock around it): the same one
    eager call, then the whole graph; exact."""
    case = LOCK
    res = C.check_parity(p2_slow_results, case)
    _check_report(res, case)
    (brk,) = res["report"]["graph_breaks"]
    assert "a break at hooks_style.py:" in brk and "with _INSTALL_LOCK" in brk, brk
    assert "one eager call" in brk, brk


def test_hooks_on_every_call_refused(p2_results):
    err = p2_results[0][_case("hooks", every_call=True)]["error"]
    for needle in ("AutoSPError", "installs hooks", "hooks_style.py:", "register_forward_hook",
                   "Fix: register the hooks in __init__"):
        assert needle in err, err


def test_cuts_fall_back_with_cause_and_fix(p2_results):
    """Slices that are neither shifts nor constant-length pieces: exact by the gather fallback,
    each named in the report with its cause and the fix."""
    res = C.check_parity(p2_results, _case("cut"))
    # no rule shards them; each runs head-parallel (the whole sequence for half of a dim it keeps
    # apart), and the report keeps why, with the fix that would shard it
    cuts = [r for r in res["report"]["regions"] if r["entry"] and r["op"] == "getitem"]
    reasons = {r["entry"] for r in cuts}
    assert len(reasons) == 2 and not res["report"]["fallbacks"], res["text"]
    assert any("grows with S" in r and "Fix: cut the batch before the model" in r
               for r in reasons), reasons
    assert any("with a step" in r and "Fix: sub-sample outside the model" in r
               for r in reasons), reasons
    assert len(res["report"]["by_class"]["slices"]["rewritten"]) == 2, res["text"]
    assert "all_gather" not in res["report"]["collectives_forward"], res["text"]



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
        assert "`x = x + h`" in msg and "test_autosp_generality.py" in msg, msg
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


def test_chunked_state_space_scan_keeps_the_chunks_sharded(launch2):
    """A Mamba-2-style chunked scan (issue 35): the cut into chunks keeps the sequence sharded
    (each rank holds whole chunks), the intra-chunk einsums run locally, and the recurrence
    across chunks runs head-parallel: exact, no gather (there were 5 of per-token values, then 2
    of chunk-level values), with the length multiple stated in the report and a call that
    breaks it refused by name."""
    for res in launch2(CHUNKED_SSD):
        _check_chunked_ssd(res, 2)


@pytest.mark.slow  # ssd_full's 2-rank launch (~150 CPU s); the unpadded scan runs by default
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


def test_a_loss_computed_on_the_gathered_sequence_counts_once(launch2):
    """A loss that no rule splits (log-sum-exp pooling over the sequence, then a classifier) is
    the same on every rank: each rank's backward counts 1/P of it, so the summed gradients are
    one device's (they were P times too large) and it is planned, not refused. The pooling runs
    head-parallel (features split) and its result is gathered over them: replicated."""
    for res in launch2(CHUNKED_SSD):
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


def test_gated_delta_rule_runs_head_parallel(launch2):
    """A gated delta rule (Gated DeltaNet's linear attention): the intra-chunk UT transform (a
    triangular solve per chunk) stays local on the rank's chunks; the loop over chunks, which
    carries a state and writes each chunk's output in place, runs head-parallel (the whole
    sequence for 1/P of the heads). Exact, no gather, no fallback. Writing in place into a
    converted copy (gathered or all-to-all'ed) redefines the value: before, the writes were
    lost and the gradients silently wrong."""
    for res in launch2(CHUNKED_SSD):
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
