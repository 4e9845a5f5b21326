"""AutoSP parity and error tests on CPU/gloo (2 and 4 ranks).

Each launch runs many cases in one set of processes (spawning and compiling dominate the cost).
Parity: the loss equals the single-device fp32 loss of the full batch and is identical on every
rank; each parameter's gradient summed over the ranks equals the single-device gradient
(relative norm of the difference <= 1e-5).
"""
from __future__ import annotations

import pytest

from tests.helpers import autosp_cases as C
from tests.helpers.dist import run_distributed
from tests.helpers.launch import Job

TOL = 1e-5

MAX_CONTEXT = (("max_context", True),)
P2_CASES = [  # the default suite: one launch, one case per kind of model code
    C.Case("gpt-tiny", layers=1),                           # our GPT: positions built inside, tied
    C.Case("llama-tiny", layers=1, ignore="first-half"),    # GQA via enable_gqa; rank 0: no target
    C.Case("llama-style"),                                  # complex RoPE, repeat_interleave GQA
    C.Case("gpt2-style", layers=1),                         # fused qkv + einops, targets inside
    C.Case("hf-style", layers=1, dict_output=True, positions=True),  # dict output, logits shard
    C.Case("hf-style", layers=1, repeat_kv=True),           # HF repeat_kv before SDPA
    C.Case("flip"),                                         # no rule: gather fallback stays exact
    C.Case("zloss"),                                        # sum-CE / numel, z-loss, L2 penalty
    C.Case("llama-style-kv1", layers=1, sac=True),          # replicated kv, output kept once, SAC
    # the max-context mode: layer stages (attention recomputed), 2 head groups (4 heads / 2 kv)
    C.Case("llama-style", sac=True, compile_opts=MAX_CONTEXT),
    C.Case("hf-style", layers=1, repeat_kv=True, compile_opts=(("attention_head_groups", 2),)),
]
SLOW_P2_CASES = [  # more spellings of the same kinds (-m slow)
    C.Case("gpt-tiny", layers=1, positions=True, ignore="some"),  # positions in, scattered ignores
    C.Case("llama-tiny", layers=1, positions=True),
    C.Case("llama-style", layers=1, positions=True, ignore="some"),
    C.Case("llama-style-kv1", layers=1),                    # 1 kv head < P: replicated kv heads
    C.Case("hf-style", layers=1),                           # enable_gqa, output object, pad+shift
    C.Case("llama-style", layers=1, sac=True),              # the joint graph through SAC
    C.Case("llama-style", sac=True, bf16=True, compile_opts=MAX_CONTEXT),  # max-context, bf16
]
P4_CASES = [C.Case("llama-style", layers=1, ignore="some"),
            C.Case("hf-style", layers=1, dict_output=True)]
# -m slow: a 2 x 2 plan (ring of Ulysses pairs) in the max-context mode (grouped ring attention)
SLOW_P4_CASES = [C.Case("llama-style", layers=1, ulysses_degree=2, sac=True,
                        compile_opts=MAX_CONTEXT)]


LONG = 4096  # tokens per sample; 2 samples, so 4096 tokens per rank
LONG_LAYERS = 1  # per-layer behaviour: a second layer only repeats it
LONG_CASES = [C.Case("llama-tiny", layers=LONG_LAYERS, seq=LONG, sac=s) for s in (False, True)]
MISC = Job("tests.helpers.autosp_cases:misc_worker")
# the default suite's 2-rank cases run in the session's shared launch (tests/helpers/launch.py)
LAUNCH = {2: P2_CASES + LONG_CASES + [MISC]}


@pytest.fixture(scope="module")
def p2_results(launch2):
    return launch2.per_rank


@pytest.fixture(scope="module")
def p4_results():
    return run_distributed(C.worker, 4, P4_CASES)


@pytest.fixture(scope="module")
def p2_slow_results():
    return run_distributed(C.worker, 2, SLOW_P2_CASES)


def _check_p2(results, case):
    res = C.check_parity(results, case)
    report = res["report"]
    if case.model == "flip":  # no rule flips a sharded sequence: the flip runs on the whole
        # sequence for half of the features (a head-parallel region), two all-to-alls, no gather
        assert [r["op"] for r in report["regions"] if r["entry"]] == ["flip"], res["text"]
        assert not report["fallbacks"], res["text"]
        assert "all_gather" not in report["collectives_forward"], res["text"]
    else:
        assert not report["fallbacks"], res["text"]
        # only the Ulysses all-to-alls and the one loss all-reduce
        assert set(report["collectives_forward"]) == {"all_to_all", "all_reduce_loss"}, res["text"]


@pytest.mark.parametrize("case", P2_CASES, ids=lambda c: c.id)
def test_parity_2_ranks(p2_results, case):
    _check_p2(p2_results, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_P2_CASES, ids=lambda c: c.id)
def test_parity_2_ranks_more_spellings(p2_slow_results, case):
    _check_p2(p2_slow_results, case)


@pytest.mark.slow  # AutoSP at 4 ranks in the default suite: tests/compiler/test_autosp_2d.py
@pytest.mark.parametrize("case", P4_CASES, ids=lambda c: c.id)
def test_parity_4_ranks(p4_results, case):
    C.check_parity(p4_results, case)


@pytest.mark.slow
def test_parity_4_ranks_max_context():
    (case,) = SLOW_P4_CASES
    out = C.check_parity(run_distributed(C.worker, 4, SLOW_P4_CASES), case)
    assert [a["head_groups"] for a in out["report"]["attention"]] == [2]


def test_max_context_mode(p2_results):
    """Whole layers are the checkpointing stages: one boundary before each attention and one
    before the loss head, found from the dataflow; every attention is recomputed in the backward;
    each rank attends its 2 query heads in 2 groups (GQA: one kv head each)."""
    _check_max_context(p2_results[0][C.Case("llama-style", sac=True, compile_opts=MAX_CONTEXT)])
    grouped = p2_results[0][C.Case("hf-style", layers=1, repeat_kv=True,
                                   compile_opts=(("attention_head_groups", 2),))]
    assert [a["head_groups"] for a in grouped["report"]["attention"]] == [2]


@pytest.mark.slow
def test_max_context_mode_bf16(p2_slow_results):
    _check_max_context(p2_slow_results[0][C.Case("llama-style", sac=True, bf16=True,
                                                 compile_opts=MAX_CONTEXT)])


def _check_max_context(res):
    assert "error" not in res, res.get("error")
    att = res["report"]["attention"]
    assert [a["head_groups"] for a in att] == [2, 2]
    assert "in 2 groups of 1" in res["text"]
    (stats,) = res["sac_stats"]
    assert stats["stage_layout"] == "layers"
    assert len(stats["layer_boundaries"]) == 3  # 2 layers' inputs + the loss head's input
    assert stats["attention_recomputed"] == 4  # 2 layers x 2 groups


def test_report_contents(p2_results):
    res = p2_results[0][C.Case("llama-style")]
    report = res["report"]
    assert report["sequence_inputs"] == {"input_ids": [1], "labels": [1]}
    assert report["local_length"] == "S/2"
    assert len(report["attention"]) == 2
    for a in report["attention"]:
        assert (a["heads"], a["heads_per_rank"], a["masking"]) == (4, 2, "causal")
        assert a["kv_plan"].startswith("kv all-to-all before the x2 repeat"), a
        assert a["location"].startswith("llama_style.py:")
    # per layer 4 all-to-alls forward and backward, one all_reduce_loss for the loss
    assert report["collectives_forward"] == {"all_reduce_loss": 1, "all_to_all": 8}
    assert report["collectives_backward"] == {"all_to_all": 8}
    assert [x["op"] for x in report["loss"]] == ["cross_entropy"]
    assert "attention ops rewritten (2)" in res["text"] and "S/2" in res["text"]


@pytest.mark.parametrize("case", [
    pytest.param(C.Case("llama-style", layers=1, sac=True), marks=pytest.mark.slow),
    C.Case("llama-style-kv1", layers=1, sac=True)], ids=lambda c: c.id)
def test_sac_hook(request, case):
    results = request.getfixturevalue("p2_results" if case in P2_CASES else "p2_slow_results")
    report = results[0][case]["report"]
    sac = report["sac"]
    assert sac["enabled"] and sac["nodes_recomputed"] > 0
    assert (sac["outputs_kept_once"], sac["attentions"]) == (1, 1)
    # the shifted-logits loss head (logits[..., :-1, :].contiguous().reshape(-1, V)) is fused
    assert len(report["loss_heads"]) == 1 and "fused" in report["loss_heads"][0]
    assert [x["op"] for x in report["loss"]] == ["linear_cross_entropy"]


@pytest.fixture(scope="module")
def long_results(request):
    model = request.param
    if model == "llama-tiny":  # the default suite's: in the shared launch
        return model, request.getfixturevalue("launch2").per_rank
    return model, run_distributed(C.worker, 2, [C.Case(model, layers=LONG_LAYERS, seq=LONG, sac=s)
                                                  for s in (False, True)])


@pytest.mark.parametrize("long_results", ["llama-tiny", pytest.param("gpt-tiny", marks=pytest.mark.slow)],
                         indirect=True)
def test_sac_saves_4x_fewer_bytes_at_long_context(long_results):
    """With SAC, AutoSP saves at least 4x fewer bytes for backward per local token than
    without, with the same loss and gradients (both checked against one device)."""
    model, long_results = long_results
    plain = C.check_parity(long_results, C.Case(model, layers=LONG_LAYERS, seq=LONG))
    sac = C.check_parity(long_results, C.Case(model, layers=LONG_LAYERS, seq=LONG, sac=True))
    assert plain["loss"] == pytest.approx(sac["loss"], rel=1e-6)
    ratio = plain["saved_per_token"] / sac["saved_per_token"]
    assert ratio >= 4.0, (plain["saved_per_token"], sac["saved_per_token"])
    # each attention keeps its output once (sequence layout): one small all-to-all more each;
    # at this length the cost model re-runs the q/k/v all-to-alls in the backward
    s, p = sac["report"], plain["report"]
    assert (s["sac"]["outputs_kept_once"], s["sac"]["attentions"]) == (LONG_LAYERS, LONG_LAYERS)
    recomm = s["sac"]["recommunicated"]
    assert recomm and set(recomm) == {"all_to_all"}, s["sac"]
    assert s["collectives_backward"] == {"all_to_all": 5 * LONG_LAYERS + len(recomm)}
    assert p["collectives_backward"] == {"all_to_all": 4 * LONG_LAYERS}
    assert not p["sac"]["enabled"] and p["sac"]["outputs_kept_once"] == 0
    assert len(s["loss_heads"]) == 1 and not p["loss_heads"]


def test_all_to_all_moved_before_repeat_kv(p2_results):
    report = p2_results[0][C.Case("hf-style", layers=1, repeat_kv=True)]["report"]
    assert report["attention"][0]["kv_plan"].startswith("kv all-to-all before the x2 repeat")


@pytest.fixture(scope="module")
def misc_results(launch2):
    return launch2(MISC)


@pytest.fixture(scope="module")
def error_results(misc_results):
    return misc_results[0]["errors"]


@pytest.mark.parametrize("key,needles", [
    ("indivisible", ["AutoSPError", "15", "not divisible", "2"]),
    ("heads", ["AutoSPError", "sequence length 18 is not a multiple of 2 x sequence-parallel size = 4",
               "1 x 2 plan", "use a multiple of 4"]),
    ("graph_break", ["AutoSPError", "graph break"]),
    ("graph_break_explicit", ["AutoSPError", "graph break"]),
    ("head_groups", ["AutoSPError", "attention_head_groups=3", "2 query heads of a rank",
                     "use one of [1, 2]"]),
])
def test_clear_errors(error_results, key, needles):
    msg = error_results[key]
    for needle in needles:
        assert needle in msg, msg


def test_a_model_without_attention_is_planned(error_results):
    """Per-token layers only: nothing to split the heads of, but nothing that needs it either
    (before: refused with "found no attention")."""
    assert error_results["no_attention"] == "no error"


def test_strategy(misc_results):
    res = [r["strategy"] for r in misc_results]
    for r in res:
        assert r["requires_grad"]
        assert r["reported"] == res[0]["reported"]
        assert abs(r["reported"] - r["ref"]) <= TOL * abs(r["ref"])
        assert "AutoSP report" in r["report"]


INDUCTOR_CASES = [C.Case("gpt-tiny", layers=1, backend="inductor"),
                  C.Case("llama-style", backend="inductor"),
                  C.Case("llama-style", layers=1, sac=True, backend="inductor"),
                  C.Case("llama-style", sac=True, backend="inductor", compile_opts=MAX_CONTEXT),
                  C.Case("llama-style", sac=True, bf16=True, backend="inductor",
                         compile_opts=MAX_CONTEXT)]


@pytest.mark.slow
@pytest.mark.parametrize("case", INDUCTOR_CASES, ids=lambda c: c.id)
def test_parity_inductor(case):
    out = C.check_parity(run_distributed(C.worker, 2, [case]), case)
    if case.sac:  # Inductor's joint-graph hook ran the attention-output pass too
        groups = [a["head_groups"] for a in out["report"]["attention"]]
        assert out["report"]["sac"]["outputs_kept_once"] == sum(groups)
