"""AutoSP on model code written unlike ours (tests/helpers/decoders/): short-range mixing by a
halo exchange, hand-written attention as a region, scans, token-routed MoE, first-call graph
breaks. Parity as in test_autosp.py (loss and every summed gradient within 1e-5 of one device,
the same loss on every rank), and the report shows no gather for these classes: no fallback, no
all_gather of the sequence (the scan case gathers only the per-rank totals of cummax)."""
from __future__ import annotations

import pytest

from tests.compiler.test_autosp import _check
from tests.helpers import autosp_cases as C
from tests.helpers.dist import run_distributed


def _case(model, backend="aot_eager", **opts):
    return C.Case(model, layers=1, opts=tuple(opts.items()), backend=backend)


# class of model code -> the report class its rewrites are listed under
CLASS = {"hooks": "graph breaks", "mixing": "short-range mixing", "einsum": "attention region", "moe": "token routing",
         "scan": "scans"}
P2_CASES = [  # the default suite (one launch): one case per class, two spellings where cheap
    _case("mixing", shift="pad", conv="pad"),         # F.pad shift, conv1d(F.pad(x, (k-1, 0)))
    _case("einsum"),                                  # einsum scores, T5 bias, softcap, tril
    _case("einsum", style="matmul", kv_heads=2),      # q @ k^T, GQA, ALiBi, sliding window
    _case("moe"),                                     # argsort, index_add back, histc counts
    _case("scan"),                                    # cumsum, cumprod, logcumsumexp, cummax
    _case("hooks"),                                   # a forward hook installed on call 1
    _case("hooks", every_call=True),                  # ... on every call: a clear refusal
    _case("cut"),                                     # x[:, :S//2], x[:, ::4]: named fallbacks
]
P4_CASES = [_case("mixing", shift="slices"),          # zeros_like(x[:, :1]) + x[:, :-1] shift
            _case("moe", back="inverse", counts="scatter")]  # inv[perm] = arange, scatter_add
SLOW_P2_CASES = [
    _case("mixing"),                                  # cat-of-slices shift, conv1d(pad)[..., :S]
    _case("mixing", shift="roll", dilation=2),        # roll + masked row 0, dilated conv
    _case("einsum", style="bmm"),                     # heads merged into the batch, triu mask
    _case("moe", back="argsort"),                     # y[argsort(perm)]
]
SLOW_P4_CASES = [_case("einsum", style="matmul", kv_heads=2), _case("scan"),
                 _case("mixing", shift="pad", conv="pad")]
INDUCTOR_CASES = [_case(m, backend="inductor", **o) for m, o in
                  (("mixing", {}), ("einsum", {}), ("moe", {}), ("scan", {}))]


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


@pytest.fixture(scope="module")
def p2_results():
    return run_distributed(C.worker, 2, P2_CASES)


PARITY_P2 = [c for c in P2_CASES if c.model in CLASS and c.model != "hooks"]


@pytest.mark.parametrize("case", PARITY_P2, ids=lambda c: c.id)
def test_parity_2_ranks(p2_results, case):
    res = _check(p2_results, case)
    report = _check_report(res, case)
    fwd = report["collectives_forward"]
    if case.model == "mixing":  # the halo exchange replaces any gather
        assert fwd.get("seq_window", 0) >= 2 and report["collectives_backward"].get(
            "seq_window_backward", 0) >= 2, res["text"]
    if case.model == "einsum":  # per region: q, k, v in and the output out, as for SDPA
        assert len(report["regions"]) == 1 and fwd["all_to_all"] >= 4, res["text"]
        assert report["regions"][0]["per_rank"] * 2 == report["regions"][0]["split"]
    if case.model == "moe":  # counts of the aux loss: one small all_reduce_sum each
        assert fwd.get("all_reduce_sum", 0) >= 1, res["text"]
    if case.model == "scan":
        assert fwd.get("exclusive_scan", 0) >= 4, res["text"]


@pytest.mark.parametrize("case", P4_CASES, ids=lambda c: c.id)
def test_parity_4_ranks(case, request):
    results = request.getfixturevalue("p4_results")
    _check_report(_check(results, case), case)


@pytest.fixture(scope="module")
def p4_results():
    return run_distributed(C.worker, 4, P4_CASES)


def test_report_lists_classes(p2_results):
    res = p2_results[0][_case("mixing", shift="pad", conv="pad")]
    assert "per class (rewritten / fallbacks):" in res["text"]
    assert "short-range mixing:" in res["text"] and "slices:" in res["text"], res["text"]
    res = p2_results[0][_case("einsum")]
    assert "hand-written attention regions (1)" in res["text"], res["text"]
    ops = res["report"]["regions"][0]["ops"]
    assert {"einsum", "tanh", "masked_fill", "softmax"} <= set(ops), ops


@pytest.mark.slow
def test_parity_more_spellings():
    for world, cases in ((2, SLOW_P2_CASES), (4, SLOW_P4_CASES)):
        results = run_distributed(C.worker, world, cases)
        for case in cases:
            _check_report(_check(results, case), case)


@pytest.mark.slow
@pytest.mark.parametrize("case", INDUCTOR_CASES, ids=lambda c: c.id)
def test_parity_inductor(case):
    _check_report(_check(run_distributed(C.worker, 2, [case]), case), case)


def test_first_call_hooks(p2_results):
    """Hooks installed on the first call: one safe eager call, then the whole graph; exact."""
    case = _case("hooks")
    res = _check(p2_results, case)
    _check_report(res, case)
    (brk,) = res["report"]["graph_breaks"]
    assert "hooks_style.py:" in brk and "register_forward_hook" in brk, brk
    assert "one eager call" in brk and "__init__" in brk, brk
    assert "first-call graph break: hooks installed" in res["text"]


def test_hooks_on_every_call_refused(p2_results):
    err = p2_results[0][_case("hooks", every_call=True)]["error"]
    for needle in ("AutoSPError", "installs hooks", "hooks_style.py:", "register_forward_hook",
                   "Fix: register the hooks in __init__"):
        assert needle in err, err


def test_cuts_fall_back_with_cause_and_fix(p2_results):
    """Slices that are neither shifts nor constant-length pieces: exact by the gather fallback,
    each named in the report with its cause and the fix."""
    res = _check(p2_results, _case("cut"))
    cuts = [f for f in res["report"]["fallbacks"] if f["op"] == "getitem"]
    reasons = {f["reason"] for f in cuts}
    assert len(reasons) == 2, res["text"]
    assert any("grows with S" in r and "Fix: cut the batch before the model" in r
               for r in reasons), reasons
    assert any("with a step" in r and "Fix: sub-sample outside the model" in r
               for r in reasons), reasons
    assert all(f["cls"] == "slices" for f in cuts)
    assert res["report"]["by_class"]["slices"]["fallbacks"], res["text"]

