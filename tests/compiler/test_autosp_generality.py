"""AutoSP on model code written unlike ours, one decoder per class of code
(tests/helpers/decoders/): short-range mixing by a halo exchange, hand-written attention as a
region, scans, token-routed MoE, first-call graph breaks, cuts of the sequence. Parity as in
test_autosp.py (loss and every summed gradient within 1e-5 of one device, the same loss on every
rank), and the report shows no gather for these classes: no fallback, no all_gather of the
sequence (the scan case gathers only the per-rank totals of cummax). The default suite runs one
case per class and the cuts' fallbacks at SP 2; more spellings, the ring plan's fallbacks, SP 4
and Inductor under -m slow. Whole model families (chunked scans, the gated delta rule, a model
without attention, research code on flattened tokens): test_autosp_generality_families.py."""
from __future__ import annotations

import pytest

from tests.helpers import autosp_cases as C
from tests.helpers.dist import run_distributed


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


# the default suite's cases run in the session's shared launch (tests/helpers/launch.py)
LAUNCH = {2: P2_CASES}


@pytest.fixture(scope="module")
def p2_results(launch2):
    return launch2.per_rank


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
