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
# the default suite: one case, one layer (a second only repeats the per-layer checks): the
# max-context mode on a Llama/Qwen-style decoder (complex RoPE, repeat_interleave GQA): layer
# stages (attention recomputed), SAC, 2 head groups (4 heads / 2 kv); Ulysses parity as every case
MAX_CONTEXT_CASE = C.Case("llama-style", layers=1, sac=True, compile_opts=MAX_CONTEXT)
P2_CASES = [MAX_CONTEXT_CASE]
SLOW_P2_CASES = [  # one case per kind of model code and more spellings of them (-m slow)
    C.Case("gpt-tiny", layers=1),                           # our GPT: positions built inside, tied
    C.Case("llama-tiny", layers=1, ignore="first-half"),    # GQA via enable_gqa; rank 0: no target
    C.Case("llama-style"),                                  # complex RoPE, repeat_interleave GQA
    C.Case("gpt2-style", layers=1),                         # fused qkv + einops, targets inside
    C.Case("hf-style", layers=1, dict_output=True, positions=True),  # dict output, logits shard
    C.Case("hf-style", layers=1, repeat_kv=True),           # HF repeat_kv before SDPA
    C.Case("flip"),                                         # no rule: gather fallback stays exact
    C.Case("zloss"),                                        # sum-CE / numel, z-loss, L2 penalty
    C.Case("llama-style-kv1", layers=1, sac=True),          # replicated kv, output kept once, SAC
    # attention_head_groups given (the max-context mode above chooses its groups itself)
    C.Case("hf-style", layers=1, repeat_kv=True, compile_opts=(("attention_head_groups", 2),)),
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
#: the clear errors (tests/helpers/autosp_cases.py:error_worker); the strategy runs under -m slow
#: (AutoSP through the trainer's strategy by default: tests/training/test_bf16.py's --autosp row)
ERRORS = Job("tests.helpers.autosp_cases:error_worker")
# the default suite's 2-rank cases run in the session's shared launch (tests/helpers/launch.py)
LAUNCH = {2: P2_CASES + [ERRORS]}


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
    each rank attends its 2 query heads in 2 groups (GQA: one kv head each). One layer here (the
    boundaries of several: the 2-layer bf16 case below, -m slow, and tests/compiler/test_sac.py's
    3-layer test_layer_stages_save_only_the_layer_inputs). The kv heads cross before their
    repeat (repeat_interleave GQA), as in test_all_to_all_moved_before_repeat_kv."""
    res = p2_results[0][MAX_CONTEXT_CASE]
    _check_max_context(res, layers=1)
    (att,) = res["report"]["attention"]
    assert att["kv_plan"].startswith("kv all-to-all before the x2 repeat"), att


@pytest.mark.slow
def test_attention_head_groups_option(p2_slow_results):
    """``attention_head_groups=2`` given (not chosen by the max-context mode): 2 groups."""
    grouped = p2_slow_results[0][C.Case("hf-style", layers=1, repeat_kv=True,
                                        compile_opts=(("attention_head_groups", 2),))]
    assert [a["head_groups"] for a in grouped["report"]["attention"]] == [2]


@pytest.mark.slow
def test_max_context_mode_bf16(p2_slow_results):
    _check_max_context(p2_slow_results[0][C.Case("llama-style", sac=True, bf16=True,
                                                 compile_opts=MAX_CONTEXT)], layers=2)


def _check_max_context(res, layers):
    assert "error" not in res, res.get("error")
    att = res["report"]["attention"]
    assert [a["head_groups"] for a in att] == [2] * layers
    assert "in 2 groups of 1" in res["text"]
    (stats,) = res["sac_stats"]
    assert stats["stage_layout"] == "layers"
    assert len(stats["layer_boundaries"]) == layers + 1  # each layer's input + the loss head's
    assert stats["attention_recomputed"] == 2 * layers  # each layer's 2 groups


@pytest.mark.slow
def test_report_contents(p2_slow_results):
    res = p2_slow_results[0][C.Case("llama-style")]
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


@pytest.mark.slow  # the attention output kept once under SAC by default: test_autosp_2d.py
@pytest.mark.parametrize("case", [C.Case("llama-style", layers=1, sac=True),
                                  C.Case("llama-style-kv1", layers=1, sac=True)],
                         ids=lambda c: c.id)
def test_sac_hook(p2_slow_results, case):
    report = p2_slow_results[0][case]["report"]
    sac = report["sac"]
    assert sac["enabled"] and sac["nodes_recomputed"] > 0
    assert (sac["outputs_kept_once"], sac["attentions"]) == (1, 1)
    # the shifted-logits loss head (logits[..., :-1, :].contiguous().reshape(-1, V)) is fused
    assert len(report["loss_heads"]) == 1 and "fused" in report["loss_heads"][0]
    assert [x["op"] for x in report["loss"]] == ["linear_cross_entropy"]


# SAC's 4x at long context in the default suite: tests/compiler/test_sac.py (one device)
@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-tiny", "gpt-tiny"])
def test_sac_saves_4x_fewer_bytes_at_long_context(model):
    """With SAC, AutoSP saves at least 4x fewer bytes for backward per local token than
    without, with the same loss and gradients (both checked against one device)."""
    long_results = run_distributed(C.worker, 2, [C.Case(model, layers=LONG_LAYERS, seq=LONG, sac=s)
                                                 for s in (False, True)])
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


@pytest.mark.slow  # by default: the max-context case's repeat_interleave GQA (test_max_context_mode)
def test_all_to_all_moved_before_repeat_kv(p2_slow_results):
    report = p2_slow_results[0][C.Case("hf-style", layers=1, repeat_kv=True)]["report"]
    assert report["attention"][0]["kv_plan"].startswith("kv all-to-all before the x2 repeat")


@pytest.fixture(scope="module")
def error_results(launch2):
    return launch2(ERRORS)[0]


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


@pytest.mark.slow
def test_strategy():
    res = run_distributed(C.strategy_worker, 2)
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
