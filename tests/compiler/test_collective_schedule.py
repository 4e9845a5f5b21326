"""The same collectives on every rank: the compile-time schedule check (compiler/schedule.py).

Single-process tests drive the exchange over a c10d ``HashStore`` standing in for the other
ranks; the 2-rank jobs run in the session's shared launch (tests/helpers/launch.py): a normal
compile agrees (and stays exact), and a compile whose SAC decision differs on one rank (a
rank-dependent cost: rank 0 prices its link as free and may recompute the whole step, so only
rank 0 re-communicates) raises an
AutoSPError on every rank naming the first differing collective, instead of hanging.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autosp_lm.compiler import AutoSPError
from autosp_lm.compiler.schedule import (collective_schedule, exchange, first_difference,
                                         schedule_hash)
from tests.helpers import autosp_cases as C
from tests.helpers.dist import run_distributed
from tests.helpers.launch import Job
from tests.training.test_bf16 import MATRIX

SEQ = 16
#: a link that costs nothing: the SAC policy re-runs forward collectives in the backward
FREE_LINK = "cpu,link_bw=1e18,link_latency=0"


def _model():
    from tests.helpers.decoders.llama_style import LlamaStyleLM
    torch.manual_seed(0)
    return LlamaStyleLM(vocab=256, n_layers=1)


def _batch():
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def agree_worker(rank, world, backend):
    """Default options: the ranks agree; the step stays the single-device one."""
    from autosp_lm.compiler import autosp_compile
    model = _model()
    ids, labels = _batch()
    ref = model(input_ids=ids, labels=labels).item()
    run = autosp_compile(model, backend=backend, verbose=False, schedule_timeout=120)
    loss = run(input_ids=ids, labels=labels)
    loss.backward()
    return {"ref": ref, "loss": loss.item(), "schedule": run.report.as_dict()["schedule"],
            "text": run.report.text()}


def diverge_worker(rank, world):
    """Rank 0 prices the link as free and may recompute the whole step (rank-dependent costs): its
    SAC pass re-communicates the first all-to-all, whose re-run frees its saved output (a free
    link alone is not enough: on a graph this small the budget of 10% goes to cheaper moves
    first), the other ranks' does not. Every rank must raise, before any step; no backward is
    run here (it would hang if the check did not catch the difference)."""
    from autosp_lm.compiler import autosp_compile
    ids, labels = _batch()
    run = autosp_compile(_model(), backend="aot_eager", verbose=False, schedule_timeout=120,
                         sac_device=FREE_LINK if rank == 0 else None,
                         sac_budget=1.0 if rank == 0 else None)
    try:
        run(input_ids=ids, labels=labels)
    except AutoSPError as e:
        return {"error": str(e)}
    return {"error": None, "recommunicated": run.report.sac.recommunicated}


DIVERGE = Job("tests.compiler.test_collective_schedule:diverge_worker")
# By default the check reads the fp32 AutoSP step (SAC on, aot_eager) of
# tests/training/test_bf16.py's matrix, the same launch item, run once; on Inductor
# (agree_worker, a 2-rank Inductor compile of its own, ~70 CPU seconds cold) it runs under
# -m slow: the schedule is read off the partitioned graphs, the same on either backend. The jobs
# run in the session's shared launch (tests/helpers/launch.py).
LAUNCH = {2: [MATRIX, DIVERGE]}


def _matrix_agree(per_rank):
    """The matrix's fp32 AutoSP step (aot_eager, SAC) in the shape of agree_worker's result."""
    return [{"ref": r["ref-fp32"]["loss"], "loss": r["autosp-fp32"]["loss"],
             "schedule": r["autosp-fp32"]["autosp_report"]["schedule"],
             "text": r["autosp-fp32"]["autosp_text"]} for r in per_rank]


# inductor: -m slow; the default suite's aot_eager case reads the same schedule (the partitioned
# graphs do not depend on the backend)
@pytest.mark.parametrize("backend", ["aot_eager",
                                     pytest.param("inductor", marks=pytest.mark.slow)])
def test_ranks_agree_and_report_the_hash(request, backend):
    res = run_distributed(agree_worker, 2, "inductor") if backend == "inductor" \
        else _matrix_agree(request.getfixturevalue("launch2")(MATRIX))
    hashes = {r["schedule"]["hash"] for r in res}
    assert len(hashes) == 1
    for r in res:
        s = r["schedule"]
        assert s["how"] == "all ranks" and s["ranks"] == 2
        assert s["forward"] > 0 and s["backward"] > 0
        assert f"hash {s['hash']}, the same on all 2 ranks" in r["text"]
        assert abs(r["loss"] - r["ref"]) <= 1e-5 * abs(r["ref"])


def test_rank_dependent_decision_raises_on_every_rank(launch2):
    res = launch2(DIVERGE)
    for rank, r in enumerate(res):
        assert r["error"] is not None, f"rank {rank} did not raise: {r}"
        assert "would run different collectives" in r["error"]
        assert "backward collective #" in r["error"], r["error"]
        assert f"rank {rank} runs" in r["error"] and f"rank {1 - rank} runs" in r["error"]


# -------------------------------------------------------------------------- one process
def _rec(op, shape=(2, 8, 4), **args):
    return {"op": op, "group": "2 ranks", "dtype": "float32", "shape": list(shape), "args": args}


FWD = [_rec("all_to_all", scatter_dim=1, gather_dim=2, world=2), _rec("all_gather", dim=1)]
BWD = [_rec("all_to_all", scatter_dim=2, gather_dim=1, world=2), _rec("reduce_scatter", dim=1)]
SCHEDULE = {"forward": FWD, "backward": BWD}
RANKS = [0, 1, 2]


def _store(entries: dict, ns="ns"):
    store = dist.HashStore()
    for key, value in entries.items():
        store.set(f"{ns}/{key}", value)
    return store


def _json(schedule):
    from autosp_lm.compiler.schedule import _canonical
    return _canonical(schedule)


def test_exchange_all_ranks_agree():
    store = _store({f"sig/{r}": _json(SCHEDULE) for r in (1, 2)})
    a = exchange(store, "ns", 0, RANKS, SCHEDULE, "sig", first=True, timeout=5, grace=1)
    assert (a.how, a.ranks, a.forward, a.backward) == ("all ranks", 3, 2, 2)
    assert a.hash == schedule_hash(SCHEDULE)


def test_exchange_names_the_first_differing_collective():
    other = {"forward": FWD, "backward": [BWD[0], _rec("all_gather", dim=1), BWD[1]]}
    store = _store({"sig/1": _json(SCHEDULE), "sig/2": _json(other)})
    with pytest.raises(AutoSPError) as e:
        exchange(store, "ns", 0, RANKS, SCHEDULE, "sig", first=True, timeout=5, grace=1)
    msg = str(e.value)
    assert "backward collective #2" in msg
    assert "rank 0 runs reduce_scatter(2 ranks, float32[2, 8, 4], dim=1)" in msg
    assert "rank 2 runs all_gather(2 ranks, float32[2, 8, 4], dim=1)" in msg


def test_exchange_shape_difference_and_missing_collective():
    shorter = {"forward": FWD[:1], "backward": BWD}
    assert first_difference(SCHEDULE, shorter) == ("forward", 1, FWD[1], None)
    wider = {"forward": [_rec("all_to_all", (2, 16, 4), scatter_dim=1, gather_dim=2, world=2),
                         FWD[1]], "backward": BWD}
    assert first_difference(SCHEDULE, wider)[:2] == ("forward", 0)
    assert first_difference(SCHEDULE, wider, shapes=False) is None


def test_exchange_bounded_when_a_rank_never_compiles():
    store = _store({"sig/1": _json(SCHEDULE)})
    with pytest.raises(AutoSPError, match=r"ranks \[2\] .* did not compile the same graph"):
        exchange(store, "ns", 0, RANKS, SCHEDULE, "sig", first=True, timeout=0.3, grace=0.1)


def test_recompile_on_one_rank_compared_with_what_the_others_run():
    """A guard failed on rank 0 only: the others run their last schedule (another length, same
    collectives): the recompile goes on; with other collectives it raises, naming them."""
    longer = {p: [dict(r, shape=[2, 16, 4]) for r in recs] for p, recs in SCHEDULE.items()}
    entries = {f"{k}/{r}": v for r in (1, 2)
               for k, v in (("old", _json(longer)), ("latest", _json(longer)),
                            ("compiling", "old"))}
    a = exchange(_store(entries), "ns", 0, RANKS, SCHEDULE, "new", first=False, timeout=5,
                 grace=0.1)
    assert a.how == "alone" and a.alone_with == [1, 2]
    other = {"forward": FWD, "backward": BWD[:1]}
    entries.update({f"latest/{r}": _json(other) for r in (1, 2)})
    with pytest.raises(AutoSPError, match="recompiled alone.*backward collective #2"):
        exchange(_store(entries), "ns", 0, RANKS, SCHEDULE, "new", first=False, timeout=5,
                 grace=0.1)


def test_schedule_of_a_graph_lists_collectives_in_order():
    import autosp_lm.parallel.collectives  # noqa: F401 - registers torch.ops.autosp_lm.*
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        y = torch.ops.autosp_lm.all_to_all(x.sin(), 1, 2, "unused", 1)
        return torch.ops.autosp_lm.all_gather(y.cos(), 1, "unused", 1)

    gm = make_fx(f)(torch.randn(2, 4, 6))
    s = collective_schedule(gm, None)
    assert [r["op"] for r in s["forward"]] == ["all_to_all", "all_gather"] and not s["backward"]
    assert s["forward"][0]["shape"] == [2, 4, 6] and s["forward"][0]["dtype"] == "float32"
    assert s["forward"][0]["args"] == {"scatter_dim": 1, "gather_dim": 2, "world": 1}


# -------------------------------------------------------------------------- 4 ranks (slow)
#: a Llama-4-style decoder of ours (chunked attention, a NoPE layer, dense-dispatch MoE whose
#: token copies take the gather fallback): the family whose SAC decision differed on one rank.
#: Wide enough (dim 128) that re-gathering the MoE input passes the cost model's latency floor.
CHUNKED_MOE = C.Case("chunked-moe", layers=2, seq=96, sac=True, opts=(("dim", 128), ("hidden", 64)))


@pytest.mark.slow
def test_llama4_style_same_decisions_on_every_rank_and_exact():
    """~4 min on 2 cores. Before the size-query fix, this case was issue 35's hang: rank 3's SAC
    pass re-gathered the MoE input in the backward and the others' did not, and the schedule
    check stopped it on every rank ("backward collective #1: rank 0 runs reduce_scatter(4 ranks,
    float32[2, 96, 1, 128], ...), rank 3 runs all_gather(4 ranks, float32[2, 24, 1, 128],
    ...)"). Now every rank reports the same schedule hash and recomputation, and the step is the
    single-device one."""
    from tests.helpers.dist import run_distributed
    results = run_distributed(C.worker, 4, [CHUNKED_MOE], timeout=1200)
    first = C.check_parity(results, CHUNKED_MOE)
    for rank, res in enumerate(r[CHUNKED_MOE] for r in results):
        rep = res["report"]
        assert rep["schedule"]["how"] == "all ranks", (rank, rep["schedule"])
        assert rep["schedule"]["hash"] == first["report"]["schedule"]["hash"], rank
        assert rep["sac"]["nodes_recomputed"] == first["report"]["sac"]["nodes_recomputed"], rank
    assert first["report"]["collectives_forward"].get("all_gather"), first["text"]
