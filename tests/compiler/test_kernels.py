"""Kernels AutoSP cannot see into, registered with ``register_kernel``: the stand-ins of
tests/helpers/kernels_standin.py (FlashAttention 2's ops under their real names, a per-head
recurrence (a custom op, or a plain Python function), a fused SwiGLU, a fused linear
cross-entropy) in a decoder that calls them as the
packages do. Each configuration runs on 2 ranks against one device: exact, with no fallback and
no all-gather. An unregistered custom op falls back, and its reason names the fix. The default
suite's configurations are an item of the session's shared 2-rank launch (tests/helpers/launch.py);
``-m slow`` runs the others in launches of their own."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.launch import Job

TOL = 1e-5
CASES = {"flash": {}, "flash-window": {"window": 5}, "varlen": {"varlen": True},
         "flash-mha": {"kv_heads": 4}, "varlen-mha": {"varlen": True, "kv_heads": 4},
         "python-scan": {"python_scan": True}}
P2 = ["flash"]  # the default suite: one launch, with the unregistered fallback
P2_SLOW = ["varlen", "python-scan"]  # -m slow: a launch of their own
P2_JOB = Job("tests.compiler.test_kernels:kernels_worker", ([*P2, "flash:unregistered"],))
LAUNCH = {2: [P2_JOB]}  # in the session's shared launch (tests/helpers/launch.py)


def register_standins():
    from autosp_lm.compiler import register_kernel
    from tests.helpers.decoders.kernel_style import decay_scan_py
    from tests.helpers.kernels_standin import define_all
    define_all()
    register_kernel("standin::decay_scan", "per_head",
                    inputs={"x": "b s h d", "decay": "b s h", "A": "h"}, outputs=("b s h d",))
    register_kernel(decay_scan_py, "per_head",
                    inputs={"x": "b s h d", "decay": "b s h", "A": "h"}, outputs=("b s h d",))
    register_kernel("standin::swiglu", "token_local", rows=("x",), dim=1)
    register_kernel("standin::linear_cross_entropy", "loss")


def kernels_worker(rank, world, cases, backend="aot_eager", bf16=False):
    import traceback

    import torch
    import torch.distributed as dist

    from autosp_lm.compiler import autosp_compile
    from autosp_lm.compiler.kernels import unregister_kernel
    from tests.helpers.decoders.kernel_style import KernelLM
    register_standins()
    out = {}
    g = torch.Generator().manual_seed(1)
    s = 8 * world
    ids = torch.randint(0, 64, (1 if "varlen" in str(cases) else 2, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    cu = torch.tensor([0, 3, s // 2 + 1, s], dtype=torch.int32)
    for case in cases:
        try:
            torch._dynamo.reset()
            name, _, extra = case.partition(":")
            if extra == "unregistered":
                unregister_kernel("standin::swiglu")
            model = KernelLM(**CASES[name])
            kw = {"cu_seqlens": cu} if CASES[name].get("varlen") else {}
            x = ids[:1] if kw else ids
            y = labels[:1] if kw else labels
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                ref = model(x, y, **kw)
            ref.backward()
            gref = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            run = autosp_compile(model, backend=backend, sac=False, verbose=False)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = run(x, y, **kw)
            loss.backward()
            errs = {}
            for n, p in model.named_parameters():
                gs = p.grad.clone()
                dist.all_reduce(gs)
                errs[n] = ((gs - gref[n]).norm() / gref[n].norm().clamp_min(1e-30)).item()
            out[case] = {"loss": loss.item(), "ref": ref.item(), "errs": errs,
                         "report": run.report.text()}
        except Exception:  # noqa: BLE001
            out[case] = {"error": traceback.format_exc()}
        finally:
            register_standins()
    return out


def forward_line(report):
    return next(line for line in report.splitlines() if "per step, forward" in line)


@pytest.fixture(scope="module")
def p2(launch2):
    return launch2(P2_JOB)  # the session's shared launch


def check_exact(results, case, tol=TOL):
    for rank, r in enumerate(res[case] for res in results):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert abs(r["loss"] - r["ref"]) <= tol * abs(r["ref"]), (r["loss"], r["ref"])
        bad = {n: e for n, e in r["errs"].items() if e > tol}
        assert not bad, (bad, r["report"])
        assert "fallbacks (0)" in r["report"], r["report"]
        assert "all_gather" not in forward_line(r["report"]), r["report"]
        assert "registered attention kernel flash_attn::" in r["report"], r["report"]
        assert "registered per_head kernel" in r["report"] and "decay_scan" in r["report"], \
            r["report"]


@pytest.mark.parametrize("case", P2)
def test_registered_kernels_exact_without_gathers(p2, case):
    check_exact(p2, case)


@pytest.mark.slow
def test_registered_kernels_varlen_and_python_scan():
    """Varlen attention (``flash_attn_varlen_func`` with ``cu_seqlens``) and the per-head
    recurrence as a plain Python function: the same checks as ``flash`` (whose registered
    per-head kernel is the custom op)."""
    results = run_distributed(kernels_worker, 2, P2_SLOW)
    for case in P2_SLOW:
        check_exact(results, case)


@pytest.mark.slow
def test_registered_kernels_window():
    """A sliding window passes through to the kernel (the same mechanism as ``flash``)."""
    check_exact(run_distributed(kernels_worker, 2, ["flash-window"]), "flash-window")


@pytest.mark.slow
def test_registered_kernels_4_ranks():
    """4 ranks: 4 query heads, 2 kv heads (each rank's kv head repeated before the all-to-all)
    and 4 kv heads."""
    cases = ["flash", "varlen", "flash-mha", "varlen-mha"]
    results = run_distributed(kernels_worker, 4, cases)
    for case in cases:
        check_exact(results, case)


@pytest.mark.slow
def test_registered_kernels_inductor_fp32_and_bf16():
    from tests.training.test_bf16 import GRAD_TOL_BF16
    results = run_distributed(kernels_worker, 2, ["flash", "varlen", "python-scan"], "inductor",
                              timeout=1800)
    for case in ("flash", "varlen", "python-scan"):
        check_exact(results, case)
    results = run_distributed(kernels_worker, 2, ["flash", "varlen"], "inductor", True,
                              timeout=1800)
    for case in ("flash", "varlen"):
        check_exact(results, case, tol=GRAD_TOL_BF16)


def test_unregistered_kernel_falls_back_and_names_the_fix(p2):
    for r in (res["flash:unregistered"] for res in p2):
        assert "error" not in r, r["error"]
        bad = {n: e for n, e in r["errs"].items() if e > TOL}
        assert not bad, bad  # the fallback is exact too
        assert "fallbacks (1)" in r["report"], r["report"]
        assert "register_kernel('standin::swiglu'" in r["report"], r["report"]


def test_register_kernel_refuses_bad_specs():
    from autosp_lm.compiler import register_kernel
    with pytest.raises(ValueError, match="kind 'rowwise' is not one of"):
        register_kernel("x::y", "rowwise")
    with pytest.raises(ValueError, match="needs rows="):
        register_kernel("x::y", "token_local")
    with pytest.raises(ValueError, match="contain 'h'"):
        register_kernel("x::y", "per_head", inputs={"x": "b s d"}, outputs=("b s d",))
    with pytest.raises(ValueError, match="needs outputs="):
        register_kernel("x::y", "per_head", inputs={"x": "b s h d"})
    with pytest.raises(ValueError, match=r"\['logits'\] are not among them"):
        register_kernel("x::y", "loss", names={"logits": "x"})
