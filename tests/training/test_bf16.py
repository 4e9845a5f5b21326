"""bf16 autocast through every strategy on 2 ranks, AutoSP's bf16 step on the default backend
(Inductor).

One launch of 2 gloo processes trains one step of a 1-layer ``llama-tiny`` (GQA, RoPE, RMSNorm;
one layer: what is checked is each strategy's arithmetic, not layer-to-layer behaviour) on the
same batch with each strategy under ``torch.autocast(bfloat16)``: ``none`` (eager),
``--compile --sac``, ``--ulysses``, ``--ring``, ``--autosp`` and the memory recipes of the
hand-written strategies. Inductor compiles (15-30 CPU seconds per rank each, cold) are kept to
one: AutoSP's bf16 step (``--autosp``). ``--compile --sac``, the compiled ALST recipe
(``ulysses+alst-compiled``, whose offload runs through the offload ops), AutoSP's fp32 step
(``autosp-fp32``: its SAC decisions, saved shapes and collective schedule are read off the
partitioned graphs, the same on either backend) and AutoSP's ``--fp32-residual-connection`` run
on aot_eager. Under ``-m slow`` a second launch runs :data:`SLOW_CONFIGS`: ``--compile`` without
SAC and the ring's compiled recipe (``ring+ac``) on aot_eager, ``--compile --sac``,
``ulysses+alst-inductor`` and the ring's compiled recipe on Inductor, ``--autosp --no-sac``, and
AutoSP's fp32 step on Inductor (``autosp-fp32-inductor``). The single-device
strategies run data-parallel (rank r gets sample r), the others sequence-parallel (both ranks get
the whole batch). Every rank also computes the single-device reference of the full batch in bf16
autocast and in fp32.

Tolerances (u = 2**-8, the unit roundoff of bf16's 8-bit significand):

* against the single-device **bf16** run: each parameter's gradient within ``4u`` relative
  (norm of the difference over the norm of the reference). Two bf16 computations of the same
  step differ by where they round: eager rounds every op's output to bf16, Inductor keeps fused
  intermediates in fp32, SP splits matmuls into row blocks. Each run is about ``2u`` from the
  exact gradient (the one-device bf16 run is measured at 6.8e-3 = 1.7u from fp32 on this model,
  7.8e-3 = 2.0u with 2 layers),
  so two of them are at most ``4u`` apart. The loss is computed in fp32 from bf16 logits; its
  measured differences are below 3e-6, the bound is ``1e-4``.
* against the single-device **fp32** run: ``8u`` (3.1e-2) per gradient, ``2e-4`` for the loss:
  the bf16 error of the run itself (2u) with a 4x margin, and still below the error of a wrong
  result: swapping the two tokens at the shard boundary, or dropping the target that the first
  shard's last position predicts (what a broken label shift at a boundary does), moves the most
  affected gradient by 1.3e-1 (dropped target) and 2.5e-1 (swapped tokens), measured on one
  device for this model. :func:`test_the_fp32_tolerance_catches_wrong_results` runs
  both through the Ulysses baseline and checks that they fail.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers.launch import Job

U = 2.0 ** -8
GRAD_TOL_BF16 = 4 * U
GRAD_TOL_FP32 = 8 * U
LOSS_TOL_BF16 = 1e-4
LOSS_TOL_FP32 = 2e-4

MODEL = "llama-tiny"
LAYERS = 1
SEQ = 64
CONFIGS = {
    "none": ("none", {}),
    # aot_eager: --compile --sac of the none strategy (torch.compile without SAC: "compile",
    # -m slow); on Inductor under -m slow ("compile-sac-inductor" below)
    "compile-sac": ("none", {"compile": True, "sac": True, "backend": "aot_eager"}),
    "ulysses": ("ulysses", {}),
    "ring": ("ring", {}),
    "autosp": ("autosp", {"sac": True}),
    # the memory techniques of the hand-written strategies (strategies/memory.py)
    # the ALST recipe compiled: its offload through the offload ops in the compiled graph
    # (aot_eager; on Inductor: "ulysses+alst-inductor", -m slow)
    "ulysses+alst-compiled": ("ulysses", {"compile": True, "backend": "aot_eager",
                                          "recompute_granularity": "full",
                                          "chunked_loss": True, "tiled_mlp": True,
                                          "tiled_mlp_chunk_tokens": 16,
                                          "cpu_offloading": True}),
    "ring+alst": ("ring", {"recompute_granularity": "full", "chunked_loss": True,
                           "tiled_mlp": True, "tiled_mlp_chunk_tokens": 16,
                           "cpu_offloading": True}),
    "none+selective": ("none", {"recompute_granularity": "selective", "chunked_loss": True}),
    # UPipe's recipe: ALST's with each rank's heads in chunks (eager; on Inductor:
    # tests/parallel/test_upipe.py, -m slow)
    "ulysses+upipe": ("ulysses", {"recompute_granularity": "full", "chunked_loss": True,
                                  "tiled_mlp": True, "tiled_mlp_chunk_tokens": 16,
                                  "cpu_offloading": True, "attention_head_chunks": 0}),
}
#: -m slow, in a launch of their own (each names the default row that covers it)
SLOW_CONFIGS = {
    # torch.compile of the none strategy without SAC: "compile-sac" compiles the same way and
    # adds SAC's pass
    "compile": ("none", {"compile": True, "backend": "aot_eager"}),
    # the ring's compiled recipe: "ulysses+alst-compiled" the compiled recipes' row (its
    # offload ops included), tests/parallel/test_ring.py the compiled ring in fp32
    "ring+ac": ("ring", {"compile": True, "backend": "aot_eager", "recompute_granularity": "full",
                         "chunked_loss": True}),
    # "compile-sac" on Inductor (fp32 on Inductor: tests/compiler/test_sac.py, -m slow)
    "compile-sac-inductor": ("none", {"compile": True, "sac": True}),
    # the ALST recipe compiled on Inductor: "ulysses+alst-compiled" on aot_eager by default
    # (Inductor in the default suite: AutoSP's "autosp" row; --compile --sac in fp32,
    # tests/compiler/test_sac.py's test_parity_inductor, is -m slow too)
    "ulysses+alst-inductor": ("ulysses", {"compile": True, "recompute_granularity": "full",
                                          "chunked_loss": True, "tiled_mlp": True,
                                          "tiled_mlp_chunk_tokens": 16,
                                          "cpu_offloading": True}),
    # the ring's compiled recipe on Inductor ("ring+ac" above on aot_eager)
    "ring+ac-inductor": ("ring", {"compile": True, "recompute_granularity": "full",
                                  "chunked_loss": True}),
    # aot_eager: what --no-sac changes is the joint graph's partition, which does not depend on
    # the backend; AutoSP in bf16 is the "autosp" row, without SAC the fp32 runs of
    # tests/training/test_pretrain_strategies.py and tests/parallel/test_document_masking.py
    "autosp-nosac": ("autosp", {"sac": False, "backend": "aot_eager"}),
}


def make_batch(seq: int, vocab: int, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1),
            "position_ids": torch.arange(seq).unsqueeze(0).expand(2, seq).contiguous()}


def swap_boundary_tokens(batch: dict) -> dict:
    """The tokens on both sides of the 2-way shard boundary exchanged (a layout bug)."""
    out = {k: v.clone() for k, v in batch.items()}
    b = out["input_ids"].size(1) // 2
    out["input_ids"][:, [b - 1, b]] = out["input_ids"][:, [b, b - 1]]
    return out


def drop_boundary_target(batch: dict) -> dict:
    """The target of the first shard's last position ignored (a label shift that loses the
    first token of the next shard)."""
    out = {k: v.clone() for k, v in batch.items()}
    out["labels"][:, out["labels"].size(1) // 2 - 1] = -100
    return out


def _grads(model) -> dict:
    return {n: (p.grad.detach().float() if p.grad is not None
                else torch.zeros(p.shape)).numpy().copy() for n, p in model.named_parameters()}


def _model(cfg):
    from autosp_lm.models import build_model
    torch.manual_seed(0)
    return build_model(cfg)


def _step(rank, world, cfg, name, options, batch, bf16=True, fp32_residual=False) -> dict:
    """One step of strategy ``name``; ``bf16``: Megatron-style (bf16 parameters, fp32 main
    parameters and gradients: the unsharded ``Sharding``), or with ``fp32_residual`` fp32
    parameters under autocast."""
    from autosp_lm.parallel.sharding import Sharding
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy
    torch._dynamo.reset()
    sp = 1 if name == "none" else world
    ps = init_parallel(sp)
    model = _model(cfg)
    sharding = Sharding(ps, bf16=bf16, fp32_residual=fp32_residual)
    sharding.wrap(model)
    strategy = build_strategy(name, ps, **dict(options, **({"verbose": False} if name == "autosp"
                                                           else {})))
    strategy.setup(model)
    if sp == 1:  # data parallel: rank r trains on sample r, gradients are averaged
        batch = {k: v[rank:rank + 1] for k, v in batch.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, reported = strategy.forward_loss(batch)
    loss.backward()
    sharding.reduce_gradients()
    reported = reported.detach().float().clone()
    if sp == 1:
        dist.all_reduce(reported)
        reported /= world
    out = {"loss": reported.item(), "grads": _grads(sharding.optimizer_module()),
           "report": strategy.report(),
           "residual_dtype": str(next(model.parameters()).dtype)}
    runner = strategy.runner
    if name == "autosp":
        out["autosp_report"] = runner.report.as_dict()
        out["autosp_text"] = runner.report.text()  # (the schedule check reads it too)
    stats = getattr(runner, "sac_stats", None)
    if stats:
        out["saved_bytes"] = stats[-1].get("saved_bytes")
        out["saved_tensors"] = stats[-1].get("saved")
    out["fused_losses"] = list(getattr(runner, "sac_fused_losses", []))
    return out


def _references(cfg, batch) -> dict:
    """The single-device runs of the whole batch: fp32, bf16 (bf16 parameters, Megatron-style)
    and bf16 autocast over fp32 parameters (--fp32-residual-connection's)."""
    from autosp_lm.parallel.precision import cast_parameters
    out = {}
    for key, bf16, params in (("ref-fp32", False, False), ("ref-bf16", True, True),
                              ("ref-bf16-fp32-residual", True, False)):
        model = _model(cfg)
        if params:  # Megatron-style: the one-device run computes with bf16 parameters
            cast_parameters(model, torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(batch["input_ids"], position_ids=batch["position_ids"],
                         labels=batch["labels"])
        loss.backward()
        out[key] = {"loss": loss.item(), "grads": _grads(model)}
    return out


def matrix_worker(rank, world, model_name, seq, layers=LAYERS):
    from autosp_lm.models import preset_config
    torch.set_num_threads(1)
    cfg = preset_config(model_name, num_layers=layers)
    batch = make_batch(seq, cfg.vocab_size)
    out = _references(cfg, batch)
    for key, (name, options) in CONFIGS.items():
        out[key] = _step(rank, world, cfg, name, options, batch)
    for key in FP32_RESIDUAL:
        name, options = CONFIGS[key]
        out[key + " fp32-residual"] = _step(rank, world, cfg, name,
                                            dict(options, **FP32_RESIDUAL_OPTIONS.get(key, {})),
                                            batch, fp32_residual=True)
    out["wrong-swap"] = _step(rank, world, cfg, "ulysses", {}, swap_boundary_tokens(batch))
    out["wrong-drop"] = _step(rank, world, cfg, "ulysses", {}, drop_boundary_target(batch))
    # aot_eager: on Inductor "autosp-fp32-inductor" (-m slow, slow_worker)
    out["autosp-fp32"] = _step(rank, world, cfg, "autosp", {"sac": True, "backend": "aot_eager"},
                               batch, bf16=False)
    return out


def slow_worker(rank, world, model_name, seq, layers=LAYERS):
    """:data:`SLOW_CONFIGS` on the batch and references of :func:`matrix_worker`, and AutoSP's
    fp32 step on Inductor (``autosp-fp32-inductor``; the default matrix's ``autosp-fp32`` runs
    it on aot_eager)."""
    from autosp_lm.models import preset_config
    torch.set_num_threads(1)
    cfg = preset_config(model_name, num_layers=layers)
    batch = make_batch(seq, cfg.vocab_size)
    out = _references(cfg, batch)
    for key, (name, options) in SLOW_CONFIGS.items():
        out[key] = _step(rank, world, cfg, name, options, batch)
    out["autosp-fp32-inductor"] = _step(rank, world, cfg, "autosp", {"sac": True}, batch,
                                        bf16=False)
    return out


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def mismatches(run: dict, ref: dict, grad_tol: float, loss_tol: float) -> list[str]:
    """What differs beyond the tolerances (empty: within them)."""
    bad = []
    err = abs(run["loss"] - ref["loss"]) / abs(ref["loss"])
    if err > loss_tol:
        bad.append(f"loss {run['loss']:.7f} vs {ref['loss']:.7f} (rel {err:.2e} > {loss_tol:.0e})")
    for n, g in ref["grads"].items():
        e = rel(run["grads"][n], g)
        if e > grad_tol:
            bad.append(f"grad {n}: rel {e:.2e} > {grad_tol:.2e}")
    return bad


#: the configurations also run with --fp32-residual-connection (fp32 parameters under autocast)
FP32_RESIDUAL = ("none", "ulysses", "ring", "autosp")
#: ... AutoSP's on aot_eager: what differs is the parameters' dtype, which its passes (SAC's
#: policy keeps the fp32 residual) see the same on either backend; its bf16 step above is on
#: Inductor (its fp32 step too under -m slow). An Inductor compile of AutoSP costs a cold suite
#: ~55-70 CPU seconds.
FP32_RESIDUAL_OPTIONS = {"autosp": {"backend": "aot_eager"}}
MATRIX = Job("tests.training.test_bf16:matrix_worker", (MODEL, SEQ))
LAUNCH = {2: [MATRIX]}  # in the session's shared launch (tests/helpers/launch.py)


def _same_loss_on_every_rank(per_rank, keys):
    for key in keys:
        assert per_rank[0][key]["loss"] == per_rank[1][key]["loss"], key
    return per_rank[0]


@pytest.fixture(scope="module")
def matrix(launch2):
    return _same_loss_on_every_rank(launch2(MATRIX), CONFIGS)


@pytest.fixture(scope="module")
def slow_matrix():
    from tests.helpers.dist import run_distributed
    return _same_loss_on_every_rank(run_distributed(slow_worker, 2, MODEL, SEQ),
                                    list(SLOW_CONFIGS) + ["autosp-fp32-inductor"])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_bf16_equals_single_device_bf16(matrix, config):
    assert not mismatches(matrix[config], matrix["ref-bf16"], GRAD_TOL_BF16, LOSS_TOL_BF16)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_bf16_equals_single_device_fp32_within_bf16_rounding(matrix, config):
    assert not mismatches(matrix[config], matrix["ref-fp32"], GRAD_TOL_FP32, LOSS_TOL_FP32)


@pytest.mark.slow  # the default row that covers each is named in SLOW_CONFIGS
@pytest.mark.parametrize("config", list(SLOW_CONFIGS))
def test_slow_rows_equal_single_device_bf16_and_fp32(slow_matrix, config):
    row = slow_matrix[config]
    assert row["residual_dtype"] == "torch.bfloat16"
    assert not mismatches(row, slow_matrix["ref-bf16"], GRAD_TOL_BF16, LOSS_TOL_BF16)
    assert not mismatches(row, slow_matrix["ref-fp32"], GRAD_TOL_FP32, LOSS_TOL_FP32)


@pytest.mark.parametrize("config", FP32_RESIDUAL)
def test_fp32_residual_connection_equals_its_single_device_run(matrix, config):
    run = matrix[config + " fp32-residual"]
    assert run["residual_dtype"] == "torch.float32"
    assert not mismatches(run, matrix["ref-bf16-fp32-residual"], GRAD_TOL_BF16, LOSS_TOL_BF16)
    assert not mismatches(run, matrix["ref-fp32"], GRAD_TOL_FP32, LOSS_TOL_FP32)


def test_bf16_computes_with_bf16_parameters(matrix):
    """Megatron-style --bf16: every strategy runs the model with bf16 parameters (the residual
    stream is bf16); the two modes are different computations (not one silently the other)."""
    for key in CONFIGS:
        assert matrix[key]["residual_dtype"] == "torch.bfloat16", key
    assert matrix["ref-bf16"]["loss"] != matrix["ref-bf16-fp32-residual"]["loss"]


def test_the_fp32_tolerance_catches_wrong_results(matrix):
    # the references themselves are within the tolerance of each other ...
    assert not mismatches(matrix["ref-bf16"], matrix["ref-fp32"], GRAD_TOL_FP32, LOSS_TOL_FP32)
    # ... and a wrong result through the same strategy is not
    for wrong in ("wrong-swap", "wrong-drop"):
        assert mismatches(matrix[wrong], matrix["ref-fp32"], GRAD_TOL_FP32, LOSS_TOL_FP32), wrong
        assert mismatches(matrix[wrong], matrix["ref-bf16"], GRAD_TOL_BF16, LOSS_TOL_BF16), wrong


def test_sac_and_the_fused_loss_head_under_bf16(matrix):
    """The models' loss head (bf16 logits, cross entropy on ``logits.float()``) is fused and
    chunked under autocast, and SAC reports its saved tensors as in fp32, in their autocast dtype:
    the q/k/v and attention-output all-to-alls it keeps are bf16, half their fp32 bytes. (The
    totals are not compared: at 64 tokens the policy's choices are priced by latency, and its
    bf16 plan keeps the MLP's bf16 matmul input, which the fp32 plan recomputes; on torch 2.13 the
    bf16 total was smaller than the fp32 one by one 256-byte tensor, on 2.11 they were equal.)"""
    for rep in (matrix["autosp"]["autosp_report"], matrix["autosp-fp32"]["autosp_report"]):
        assert len(rep["loss_heads"]) == 1 and "fused" in rep["loss_heads"][0], rep["loss_heads"]
        assert [x["op"] for x in rep["loss"]] == ["linear_cross_entropy"]
        assert rep["sac"]["enabled"] and rep["sac"]["saved_bytes"] > 0
        assert rep["sac"]["saved_bytes"] < rep["sac"]["saved_bytes_no_recompute"]
    assert matrix["autosp"]["saved_bytes"] > 0
    kept = {key: [x for x in matrix[key]["saved_tensors"] if x["op"] == "all_to_all"]
            for key in ("autosp", "autosp-fp32")}
    assert kept["autosp"] and [x["shape"] for x in kept["autosp"]] == \
        [x["shape"] for x in kept["autosp-fp32"]], kept
    assert {x["dtype"] for x in kept["autosp"]} == {"bfloat16"}, kept["autosp"]
    assert {x["dtype"] for x in kept["autosp-fp32"]} == {"float32"}, kept["autosp-fp32"]
    assert 2 * sum(x["bytes"] for x in kept["autosp"]) == \
        sum(x["bytes"] for x in kept["autosp-fp32"])
    assert len(matrix["compile-sac"]["fused_losses"]) == 1
    assert not mismatches(matrix["autosp-fp32"], matrix["ref-fp32"], 1e-5, 1e-5)


@pytest.mark.slow  # the default suite's "compile-sac" runs the same pass on aot_eager (above)
def test_sac_fuses_the_loss_head_under_bf16_on_inductor(slow_matrix):
    assert len(slow_matrix["compile-sac-inductor"]["fused_losses"]) == 1


@pytest.mark.slow  # the default suite's "autosp-fp32" runs this step on aot_eager
# (test_sac_and_the_fused_loss_head_under_bf16) and AutoSP on Inductor in bf16 ("autosp")
def test_autosp_fp32_on_inductor_equals_single_device_fp32(slow_matrix):
    row = slow_matrix["autosp-fp32-inductor"]
    assert row["residual_dtype"] == "torch.float32"
    assert not mismatches(row, slow_matrix["ref-fp32"], 1e-5, 1e-5)
