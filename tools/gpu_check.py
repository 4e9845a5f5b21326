#!/usr/bin/env python
"""The GPU check: one command that runs the CUDA paths no CPU test can, prints one table and
writes JSON (and the table as Markdown) for docs/bench/.

    python tools/gpu_check.py --output docs/bench/gpu_check        # on one GPU, under 8 minutes
    python tools/gpu_check.py --smoke --output /tmp/gpu_check      # CPU: the harness itself

Sections (each a row or a few in the table; a section that cannot run says why):

* ``env``: torch, CUDA, device, which SDPA kernels and apex are there;
* ``attention_output_once``: the attention-output stand-in of the AutoSP joint-graph pass on the
  flash, memory-efficient and cuDNN SDPA backward kernels in bf16 and fp16: the error of the
  gradients against fp64 must stay that of the stock kernel (x1.1 + 1e-3);
* ``attention_workspace``: the memory planner's formula for the attention backward's own scratch
  (``autosp_lm/planner/workspace.py``: FlashAttention-2's fp32 dq accumulator, ``softmax_d``,
  GQA's expanded dk/dv) against ``max_memory_allocated`` of the bf16 flash backward beyond its
  gradients, MHA and GQA shapes (the CUDA formula is not measured anywhere else);
* ``ring_kernels``: ring attention's CUDA block kernels (flash, efficient) against fp64 math,
  forward and backward, and which one ``select_kernel`` picks;
* ``simulated_sp``: ``--autosp`` and ``--ulysses`` on one GPU as one rank of an 8-way SP job
  (a fake process group: collectives return correctly shaped, meaningless tensors, so memory and
  compute are one rank's and communication is excluded) on ``llama-3.2-1b`` in bf16 at 8K and 32K
  tokens and the longest sequence that fits (doubling, then bisecting): peak
  ``torch.cuda.max_memory_allocated``, tokens/s, TFLOP/s per device and MFU;
* ``packed_attention``: the models' document-masked attention on CUDA (FlexAttention with a
  block mask built from document ranges) against SDPA with the dense mask, and its time against
  full causal attention on the same packed batch;
* ``simulated_2d``: AutoSP's Ulysses x ring plans at SP=8 (8x1, 4x2, 2x4) on ``llama-3.2-1b``,
  bf16, 32K tokens, one simulated rank: step time, tokens/s and peak memory per factorisation;
* ``peak_memory``: peak memory (``max_memory_allocated`` and the step's live peak) at 16K tokens
  and the longest context per GPU of Ulysses, AutoSP without SAC, AutoSP and AutoSP with
  activation offload, as one rank of an 8-way SP job on ``llama-3.2-1b`` in bf16 (fake process
  group, like ``simulated_sp``), with each one's max context relative to Ulysses;
* ``plan_vs_measured``: the memory planner (``tools/plan_memory.py``) against the GPU: its
  prediction of one rank's peak (traced on fake tensors on the CPU, no GPU used) next to
  ``torch.cuda.max_memory_allocated`` of the same compiled program run for real on the GPU as
  one rank of an 8-way SP job (fake process group), for ``none``, ``autosp`` and ``ulysses`` on
  ``llama-3.2-1b`` in bf16 at 8K tokens, and ``autosp`` with its parameters sharded over the 8
  ranks by graph FSDP (``--use-torch-fsdp2``; the planner traces the sharded step); error of
  the whole peak and of the step's part (the planner's CPU validation tolerance, 10%). The
  measured program is the planner's (AutoSP on aot_eager, the others op by op): Inductor's fused
  kernels allocate less (``peak_memory``);
* ``optimizer``: one AdamW step through the apex ``FusedAdam`` path when apex is built and the
  torch fused path otherwise (both when possible), against a float64 reference;
* ``fsdp``: sharded model state (``tools/gpu_check_fsdp.py``): peak memory, model-state bytes and
  step time of one simulated rank of an 8-way job with ``--use-torch-fsdp2`` (native FSDP2 under
  ``--ulysses``, graph FSDP under ``--autosp``) and ``--use-distributed-optimizer`` against
  unsharded; torch's fused AdamW on DTensor parameters; ``dcp.async_save`` of CUDA state.

No network and no wandb are needed. ``--time-limit`` bounds the whole run (sections that do not
fit are reported as skipped, never silently dropped). ``--smoke`` runs the same code on CPU with
tiny shapes (llama-tiny, 2-way simulated SP, aot_eager) so that the harness is tested in CI.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpu_check_fsdp  # noqa: E402 - the fsdp section (tools/ is on the path with this script)
import gpu_check_recipes  # noqa: E402 - the recipes section

WORKER_FLAG = "--worker"


# ============================================================================ helpers
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


class Row(dict):
    """One line of the table: section, check, status (ok / FAIL / skipped), figures, note."""

    def __init__(self, section, check, status, note="", **figures):
        super().__init__(section=section, check=check, status=status, note=note, **figures)


# ============================================================================ attention output
class AttentionBlock(torch.nn.Module):
    """``[B, S, C]`` -> Ulysses-style attention (world-1 all-to-alls, the graph structure of the
    AutoSP rewrite) -> output projection."""

    def __init__(self, dim=32, heads=4, ulysses=True, dtype=torch.float32):
        super().__init__()
        self.heads, self.ulysses = heads, ulysses
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x):
        import autosp_lm.parallel.collectives  # noqa: F401 - registers autosp_lm::all_to_all
        a2a = torch.ops.autosp_lm.all_to_all
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if self.ulysses:
            q, k, v = (a2a(t.contiguous(), 1, 2, "unused", 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.ulysses:
            o = a2a(o.contiguous(), 2, 1, "unused", 1)
        return self.proj(o.transpose(1, 2).reshape(B, S, C))


def run_attention_block(model, x, grad, rewrite: bool):
    """Forward + backward of ``model`` compiled with aot_eager, with (``rewrite``) or without the
    attention-output-once pass, as the AutoSP backend runs it (with SAC). Returns the gradients
    of ``x`` and the parameters and what the partition saved."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from autosp_lm.compiler.passes.attention_output_once import keep_attention_output_once
    from autosp_lm.compiler.passes.sac import apply_sac, partition_saved_bytes
    from autosp_lm.compiler.pipeline import boxed_nop
    seen = {}

    def partition(joint, inputs, **kw):
        seen["rewritten"] = keep_attention_output_once(joint) if rewrite else 0
        apply_sac(joint, budget=10.0, num_fwd_outputs=kw["num_fwd_outputs"])
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        seen["saved"] = partition_saved_bytes(fw, kw["num_fwd_outputs"])
        return fw, bw

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    fn = torch.compile(model, backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                                   partition_fn=partition))
    fn(x).backward(grad)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return [g.detach().clone() for g in grads], seen


def attention_output_errors(device, dtype, dim=256, heads=4, seq=512, kernel=None) -> dict:
    """Errors against fp64 of the stock backward and of the rewritten one, per gradient.
    ``kernel``: an ``SDPBackend`` name to force (CUDA)."""
    import contextlib
    torch.manual_seed(0)
    model = AttentionBlock(dim=dim, heads=heads, dtype=dtype).to(device)
    x = torch.randn(2, seq, dim, dtype=dtype, device=device)
    grad = torch.randn(2, seq, dim, dtype=dtype, device=device)
    ctx = contextlib.nullcontext()
    if kernel is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel(getattr(SDPBackend, kernel))
    with ctx:
        ref, _ = run_attention_block(model, x, grad, rewrite=False)
        got, seen = run_attention_block(model, x, grad, rewrite=True)
    exact_model = AttentionBlock(dim=dim, heads=heads, ulysses=False, dtype=torch.float64).to(device)
    exact_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    xe = x.double().requires_grad_()
    exact_model(xe).backward(grad.double())
    exact = [xe.grad] + [p.grad for p in exact_model.parameters()]
    return dict(rewritten=seen.get("rewritten", 0),
                stock=[rel(b, e) for b, e in zip(ref, exact)],
                rewritten_err=[rel(a, e) for a, e in zip(got, exact)])


def section_attention_output(args, deadline) -> list:
    rows = []
    if args.smoke:
        cases = [(None, torch.bfloat16)]
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        return [Row("attention_output_once", "CUDA kernels", "skipped", "no CUDA device")]
    else:
        device = torch.device("cuda")
        cases = [(k, d) for k in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
                 for d in (torch.bfloat16, torch.float16)]
    for kernel, dtype in cases:
        name = f"{kernel or 'cpu flash'} {str(dtype).split('.')[-1]}"
        if time.time() > deadline:
            rows.append(Row("attention_output_once", name, "skipped", "time limit"))
            continue
        try:
            e = attention_output_errors(device, dtype, kernel=kernel,
                                        **({"dim": 32, "seq": 128} if args.smoke else {}))
        except RuntimeError as err:  # kernel not built / not supported on this GPU
            rows.append(Row("attention_output_once", name, "skipped",
                            str(err).strip().splitlines()[0][:120]))
            continue
        ok = e["rewritten"] == 1 and all(a <= 1.1 * b + 1e-3
                                         for a, b in zip(e["rewritten_err"], e["stock"]))
        rows.append(Row("attention_output_once", name, "ok" if ok else "FAIL",
                        f"rewritten {e['rewritten']}",
                        max_err_stock=max(e["stock"]), max_err_rewritten=max(e["rewritten_err"])))
    return rows


# ============================================================================ attention workspace
def attention_workspace_row(device, dtype, b, h, hk, s, d) -> dict:
    """The SDPA backward's memory beyond its gradients, measured (CUDA: ``max_memory_allocated``;
    CPU: ``LivePeak``) against the planner's formula (``planner/workspace.py``) for the device."""
    import contextlib

    from autosp_lm.planner.workspace import TensorSpec, kernel_workspace
    from autosp_lm.training.memory import LivePeak
    torch.manual_seed(0)

    def leaf(heads):  # [B, S, H, D] storage seen as [B, H, S, D], as a model's transpose gives
        return torch.randn(b, s, heads, d, dtype=dtype, device=device).transpose(1, 2) \
            .detach().requires_grad_()
    q, k, v = leaf(h), leaf(hk), leaf(hk)
    ctx = contextlib.nullcontext()
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    with ctx:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != h)
        go = torch.randn_like(out)
        with LivePeak(device) as lp:
            grads = torch.autograd.grad(out, (q, k, v), go)
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    measured = lp.peak - grad_bytes
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    predicted = kernel_workspace(device.type)(op, [TensorSpec.of(go), TensorSpec.of(q),
                                                    TensorSpec.of(k)])
    return dict(measured=measured, predicted=predicted)


def section_attention_workspace(args, deadline) -> list:
    """The planner's attention-backward workspace formula against the kernel on this device:
    CUDA FlashAttention-2 in bf16 (the fp32 dq accumulator, softmax_d, GQA's expanded dk/dv;
    not measured anywhere before a GPU run), CPU flash in fp32 under ``--smoke`` (exact)."""
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        cases = [(1, 4, 2, 1024, 32), (1, 2, 2, 300, 16)]
    elif not torch.cuda.is_available():
        return [Row("attention_workspace", "CUDA flash backward", "skipped", "no CUDA device")]
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        cases = [(1, 8, 8, 8192, 128), (1, 32, 8, 16384, 128), (2, 16, 4, 3000, 64)]
    rows = []
    for b, h, hk, s, d in cases:
        name = f"B{b} H{h}/{hk} S{s} D{d} {str(dtype).split('.')[-1]}"
        if time.time() > deadline:
            rows.append(Row("attention_workspace", name, "skipped", "time limit"))
            continue
        try:
            r = attention_workspace_row(device, dtype, b, h, hk, s, d)
        except RuntimeError as err:  # kernel not built / not supported on this GPU
            rows.append(Row("attention_workspace", name, "skipped",
                            str(err).strip().splitlines()[0][:120]))
            continue
        # the caching allocator rounds blocks up (512 B; 2 MiB segments for large ones): allow
        # that much, and 5% of the formula on CUDA (a kernel version may differ); CPU: exact
        # but for the row sums of the threads that ran at once (qs fp32 values each)
        slack = 0.05 * r["predicted"] + (4 << 20) if device.type == "cuda" else 4096
        ok = abs(r["measured"] - r["predicted"]) <= slack
        rows.append(Row("attention_workspace", name, "ok" if ok else "FAIL",
                        "beyond the gradients", measured_mib=r["measured"] / 2**20,
                        predicted_mib=r["predicted"] / 2**20))
    return rows


# ============================================================================ ring kernels
def section_ring_kernels(args, deadline) -> list:
    from autosp_lm.parallel import ring_kernels as rk
    from autosp_lm.parallel.ring import ring_attention
    if args.smoke:
        device, kernels, dtypes = torch.device("cpu"), ("cpu_flash", "math"), (torch.float32,)
    elif not torch.cuda.is_available():
        return [Row("ring_kernels", "CUDA kernels", "skipped", "no CUDA device")]
    else:
        device = torch.device("cuda")
        kernels, dtypes = ("cuda_flash", "cuda_efficient"), (torch.bfloat16, torch.float16,
                                                              torch.float32)
    rows = []
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-3}
    for kernel in kernels:
        for dtype in dtypes:
            name = f"{kernel} {str(dtype).split('.')[-1]}"
            if time.time() > deadline:
                rows.append(Row("ring_kernels", name, "skipped", "time limit"))
                continue
            gen = torch.Generator(device="cpu").manual_seed(0)
            errs = []
            try:
                for sq, sk, causal in ((256, 256, True), (128, 256, False)):
                    q, k, v, do = (torch.randn(2, 4, n, 64, generator=gen).to(device, dtype)
                                   for n in (sq, sk, sk, sq))
                    scale = 1.0 / math.sqrt(64)
                    aux = rk.cuda_aux(kernel, q, k, v) if kernel.startswith("cuda") else None
                    out, lse = rk.block_forward(kernel, q, k, v, causal, scale)
                    ref_out, ref_lse = rk._math_fwd(q.double(), k.double(), v.double(), causal,
                                                    scale)
                    grads = rk.block_backward(kernel, do, q, k, v, out, lse, causal, scale, aux)
                    ref = rk._math_bwd(do.double(), q.double(), k.double(), v.double(), ref_out,
                                       ref_lse, causal, scale)
                    errs += [rel(a, b) for a, b in [(out, ref_out), (lse, ref_lse)]
                             + list(zip(grads, ref))]
            except (RuntimeError, ValueError, NotImplementedError) as err:
                rows.append(Row("ring_kernels", name, "skipped",
                                str(err).strip().splitlines()[0][:120]))
                continue
            chosen = rk.select_kernel(device, dtype, 64)
            ok = max(errs) <= tol[dtype]
            rows.append(Row("ring_kernels", name, "ok" if ok else "FAIL",
                            f"select_kernel picks {chosen}", max_err=max(errs)))
    # the whole ring op on one rank (world 1) against SDPA, through autograd
    if time.time() < deadline:
        dtype = torch.float32 if args.smoke else torch.bfloat16
        q, k, v = (torch.randn(1, 8, 512, 64, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        out = ring_attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g1 = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        g2 = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
        err = max([rel(out, ref)] + [rel(a, b) for a, b in zip(g1, g2)])
        rows.append(Row("ring_kernels", "ring_attention world 1 vs SDPA", "ok"
                        if err <= (1e-4 if dtype == torch.float32 else 3e-2) else "FAIL",
                        str(dtype).split(".")[-1], max_err=err))
    return rows


# ============================================================================ simulated SP
def simulated_worker(cell: dict) -> dict:
    """One strategy as one rank of a ``world``-way SP job (fake process group): each length in
    ``cell["lengths"]``, then the longest length that fits (doubling, then bisecting)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autosp_lm.data.mock import MockGPTDataset
    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy
    from autosp_lm.training.flops import flops_per_step, peak_tflops
    from autosp_lm.training.optimizer import build_optimizer
    from autosp_lm.training.step import finish_step, forward_backward

    world = cell["world"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    ps = init_parallel(world, device=cell["device"])
    cfg = preset_config(cell["model"], max_position_embeddings=1 << 24)
    torch.manual_seed(0)
    model = build_model(cfg).to(ps.device)
    options = dict(compile=True, backend=cell["backend"]) if cell["strategy"] == "ulysses" \
        else dict(backend=cell["backend"], verbose=False)
    if cell.get("ulysses_degree"):
        options["ulysses_degree"] = cell["ulysses_degree"]
    options.update(cell.get("options") or {})
    strategy = build_strategy(cell["strategy"], ps, **options)
    strategy.setup(model)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0, device=ps.device)
    peak = peak_tflops(ps.device, cell["bf16"])
    deadline = time.time() + cell["budget_s"]

    def measure(seq: int, steps: int) -> dict:
        data = MockGPTDataset(cfg.vocab_size, seq, 1, seed=0)
        batch = {k: data[0][k].unsqueeze(0).to(ps.device) for k in ("input_ids", "labels")}

        def step():
            optimizer.zero_grad(set_to_none=True)
            forward_backward(strategy, batch, bf16=cell["bf16"], device=ps.device)
            finish_step(model, optimizer, dp_size=1)
            if ps.device.type == "cuda":
                torch.cuda.synchronize(ps.device)

        try:
            t0 = time.perf_counter()
            step()  # warm-up (compiles at the first length)
            first = time.perf_counter() - t0
            live = None
            if cell.get("live_peak"):
                from autosp_lm.training.memory import LivePeak
                optimizer.zero_grad(set_to_none=True)
                with LivePeak(ps.device) as lp:  # the step's own tensors above weights + states
                    forward_backward(strategy, batch, bf16=cell["bf16"], device=ps.device)
                    finish_step(model, optimizer, dp_size=1)
                live = lp.peak
            if ps.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ps.device)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            if ps.device.type == "cuda":
                torch.cuda.empty_cache()
            return {"seq_length": seq, "status": "oom"}
        dt = min(times)
        tflops = flops_per_step(cfg, seq, seq) / world / dt / 1e12
        out = {"seq_length": seq, "status": "ok", "step_s": dt, "first_step_s": first,
               "tokens_per_s": seq / dt, "tokens_per_s_per_device": seq / world / dt,
               "tflops_per_device": tflops, "mfu": tflops / peak if peak else None}
        if ps.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(ps.device) / 2**30
        if live is not None:
            out["peak_live_gib"] = live / 2**30
        return out

    results = [measure(L, cell["steps"]) for L in cell["lengths"]]
    fits = max([r["seq_length"] for r in results if r["status"] == "ok"], default=0)
    lo, hi = fits, None
    seq = max(cell["lengths"]) * 2
    while time.time() < deadline and seq <= cell["max_search"]:
        r = measure(seq, 1)
        results.append(r)
        if r["status"] != "ok":
            hi = seq
            break
        lo, seq = seq, seq * 2
    step_len = cell["granularity"]
    while hi is not None and hi - lo > step_len and time.time() < deadline:
        mid = (lo + hi) // 2 // step_len * step_len
        if mid <= lo:
            break
        r = measure(mid, 1)
        results.append(r)
        lo, hi = (mid, hi) if r["status"] == "ok" else (lo, mid)
    return {"strategy": cell["strategy"], "results": results, "max_fit": lo,
            "first_oom": hi, "search_done": hi is not None or seq > cell["max_search"]}


def run_cells(section: str, cells: list, stop: float, rows: list, slack: float = 15.0):
    """Run the worker of each ``(check, cell)`` in turn, each given an even share of the time
    left before ``stop`` (``cell["budget_s"]``, the worker's own limit, ``slack`` seconds less);
    a cell with under 30 s left is recorded in ``rows`` as skipped, a failed one as FAIL. Yields
    ``(check, result)`` of the cells that ran."""
    for i, (check, cell) in enumerate(cells):
        left = stop - time.time()
        if left < 30:
            rows.append(Row(section, check, "skipped", "time limit"))
            continue
        cell["budget_s"] = left / (len(cells) - i) - slack
        res = run_worker(cell, timeout=max(30.0, left - 5))
        if "error" in res:
            rows.append(Row(section, check, "FAIL", str(res["error"])[-300:]))
            continue
        yield check, res


def length_row(section: str, check: str, r: dict, keep=None) -> Row:
    """The row of one measured length ``r`` of a simulated worker (its figures, or ``keep``)."""
    status = "ok" if r["status"] == "ok" else r["status"]
    return Row(section, f"{check} S={r['seq_length']}", status,
               **{k: v for k, v in r.items() if k not in ("seq_length", "status")
                  and (keep is None or k in keep)})


def section_simulated_sp(args, deadline) -> list:
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("simulated_sp", "--autosp / --ulysses", "skipped", "no CUDA device")]
    rows = []
    cells = [(strategy, dict(strategy=strategy, world=2 if smoke else 8,
                             model="llama-tiny" if smoke else "llama-3.2-1b",
                             device="cpu" if smoke else "cuda", bf16=True,
                             backend="aot_eager" if smoke else "inductor",
                             lengths=[128, 256] if smoke else [8192, 32768],
                             steps=1 if smoke else 3, max_search=1024 if smoke else 1 << 21,
                             granularity=128 if smoke else 8192))
             for strategy in ("autosp", "ulysses")]
    for strategy, res in run_cells("simulated_sp", cells, deadline, rows):
        rows.extend(length_row("simulated_sp", strategy, r) for r in res["results"])
        rows.append(Row("simulated_sp", f"{strategy} longest sequence that fits", "ok",
                        "" if res["search_done"] else "search stopped by the time limit",
                        max_fit=res["max_fit"], first_oom=res["first_oom"]))
    return rows


def section_simulated_2d(args, deadline) -> list:
    """AutoSP's 2-D plan at SP=8 on one GPU (one simulated rank): U x R in 8x1, 4x2, 2x4 at 32K
    tokens of llama-3.2-1b in bf16 (communication excluded: what each factorisation costs in
    compute and memory per rank)."""
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("simulated_2d", "--autosp U x R", "skipped", "no CUDA device")]
    world = 4 if smoke else 8
    degrees = (2,) if smoke else (8, 4, 2)  # smoke: 2 x 2, both the all-to-all and the ring
    cells = [(f"autosp {U}x{world // U}",
              dict(strategy="autosp", world=world, ulysses_degree=U,
                   model="llama-tiny" if smoke else "llama-3.2-1b",
                   device="cpu" if smoke else "cuda", bf16=True,
                   backend="aot_eager" if smoke else "inductor",
                   lengths=[256] if smoke else [32768], steps=1 if smoke else 3,
                   max_search=0, granularity=8192)) for U in degrees]
    rows = []
    for name, res in run_cells("simulated_2d", cells, deadline, rows, slack=10.0):
        rows.append(length_row("simulated_2d", name, res["results"][0]))
    return rows


#: ``peak_memory``: the strategies compared (name, registry name, options).
PEAK_STRATEGIES = [("ulysses", "ulysses", {}),
                   ("autosp-nosac", "autosp", {"sac": False}),
                   ("autosp", "autosp", {}),
                   ("autosp-offload", "autosp", {"offload_activations": True})]


def section_peak_memory(args, deadline) -> list:
    """Peak memory and the longest context per GPU: hand-written Ulysses, AutoSP without SAC,
    AutoSP (communication-aware SAC, sequence tiling) and AutoSP with activation offload, as one
    rank of an 8-way SP job (fake process group) on ``llama-3.2-1b`` in bf16 at 16K tokens:
    ``max_memory_allocated`` (weights and states included), the step's live peak above them, and
    the longest sequence that fits (doubling, then bisecting). ``--smoke``: llama-tiny, 2 ranks,
    Ulysses and AutoSP with offload at 256 tokens, no search."""
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("peak_memory", "peak memory and max context", "skipped", "no CUDA device")]
    chosen = [PEAK_STRATEGIES[0], PEAK_STRATEGIES[3]] if smoke else PEAK_STRATEGIES
    share = 0.5 * (deadline - time.time())  # the other half is left to simulated_sp
    stop = time.time() + share
    cells = [(label, dict(strategy=name, options=options, live_peak=True, world=2 if smoke else 8,
                          model="llama-tiny" if smoke else "llama-3.2-1b",
                          device="cpu" if smoke else "cuda", bf16=True,
                          backend="aot_eager" if smoke else "inductor",
                          lengths=[256] if smoke else [16384], steps=1,
                          max_search=256 if smoke else 1 << 21,
                          granularity=128 if smoke else 8192))
             for label, name, options in chosen]
    rows, fits = [], {}
    for label, res in run_cells("peak_memory", cells, stop, rows):
        rows.extend(length_row("peak_memory", label, r, keep=("peak_mem_gib", "peak_live_gib",
                                                               "tokens_per_s", "step_s"))
                    for r in res["results"])
        fits[label] = res["max_fit"]
        if not smoke:
            rows.append(Row("peak_memory", f"{label} longest sequence that fits", "ok",
                            "" if res["search_done"] else "search stopped by the time limit",
                            max_fit=res["max_fit"], first_oom=res["first_oom"]))
    if "ulysses" in fits and not smoke:
        best = max((v, k) for k, v in fits.items())
        rows.append(Row("peak_memory", "max context vs ulysses", "ok",
                        ", ".join(f"{k} {v / max(1, fits['ulysses']):.2f}x" for k, v in fits.items())
                        + f"; longest: {best[1]}"))
    return rows


#: ``plan_vs_measured``: the planner's strategies compared (full run; --smoke: autosp only), and
#: AutoSP under graph FSDP in both
PLAN_STRATEGIES = ("none", "autosp", "ulysses")


def plan_worker(cell: dict) -> dict:
    """The planner's prediction of strategy ``cell["strategy"]`` at ``cell["seq"]`` tokens (a
    trace on fake tensors on the CPU) and the measured peak of the same step run for real on
    ``cell["device"]`` (``planner.check.measure_step``), one rank of ``cell["sp"]``."""
    from autosp_lm.planner.check import measure_step
    from autosp_lm.planner.plan import Layout, predict, trace_step
    from autosp_lm.planner.trace import model_config
    name, sp, seq, bf16 = cell["strategy"], cell["sp"], cell["seq"], cell["bf16"]
    fsdp2 = bool(cell.get("fsdp2"))
    cfg = model_config(cell["model"], {}, seq=seq)
    layout = Layout(world=sp, fsdp2=fsdp2, bf16=bf16, device=cell["device"])
    t0 = time.perf_counter()
    traced = trace_step(name, cfg, sp, seq, bf16=bf16, layout=layout)
    pred = predict(traced, seq, layout)
    trace_s = time.perf_counter() - t0
    meas = measure_step(name, cfg, sp, seq, world=sp, bf16=bf16, device=cell["device"],
                        fsdp2=fsdp2)
    p_step = pred["peak_bytes"] - pred["static_bytes"]
    return {"predicted_gib": pred["peak_bytes"] / 2**30,
            "measured_gib": meas["measured_peak_bytes"] / 2**30,
            "peak_error": pred["peak_bytes"] / meas["measured_peak_bytes"] - 1,
            "step_error": p_step / max(1, meas["measured_step_peak_bytes"]) - 1,
            "predicted_phase": pred["peak_phase"], "trace_s": trace_s,
            "measure_s": meas["measure_s"],
            "custom_ops_not_counted": pred["custom_ops_not_counted"]}


def section_plan_vs_measured(args, deadline) -> list:
    """The memory planner's predicted peak against the measured one (``max_memory_allocated``
    on CUDA; on CPU, ``--smoke``, the exact ``LivePeak``: llama-tiny, SP=2, 256 tokens)."""
    from autosp_lm.planner.check import TOLERANCE
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("plan_vs_measured", "planner vs max_memory_allocated", "skipped",
                    "no CUDA device")]
    # (strategy, FSDP2): AutoSP also with its parameters sharded by graph FSDP over the SP
    # ranks, which the planner traces (its gathers and reduce-scatters are graph nodes)
    chosen = ([("autosp", False), ("autosp", True)] if smoke
              else [(n, False) for n in PLAN_STRATEGIES] + [("autosp", True)])
    stop = time.time() + 0.3 * (deadline - time.time())  # the rest is left to the others
    seq, sp = (256, 2) if smoke else (8192, 8)
    cells = [(f"{name}{' FSDP2' if fsdp2 else ''} S={seq} SP={sp}",
              dict(worker="plan", strategy=name, sp=sp, seq=seq, bf16=True, fsdp2=fsdp2,
                   model="llama-tiny" if smoke else "llama-3.2-1b",
                   device="cpu" if smoke else "cuda")) for name, fsdp2 in chosen]
    rows = []
    for check, res in run_cells("plan_vs_measured", cells, stop, rows):
        ok = abs(res["peak_error"]) <= TOLERANCE and abs(res["step_error"]) <= TOLERANCE
        missed = res["custom_ops_not_counted"]
        rows.append(Row("plan_vs_measured", check, "ok" if ok else "FAIL",
                        f"predicted {res['predicted_gib']:.4g} GiB vs measured "
                        f"{res['measured_gib']:.4g} GiB ({100 * res['peak_error']:+.1f}%, step "
                        f"{100 * res['step_error']:+.1f}%; tolerance {100 * TOLERANCE:.0f}%)"
                        + (f"; not counted: {missed}" if missed else ""),
                        peak_mem_gib=res["measured_gib"], predicted_gib=res["predicted_gib"],
                        peak_error=res["peak_error"], step_error=res["step_error"]))
    return rows


def run_worker(cell: dict, timeout: float) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, json.dumps(cell), path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    try:
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout)[-2000:]}
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


# ============================================================================ packed documents
def section_packed_attention(args, deadline) -> list:
    """Document-masked attention of the models' entry point on CUDA (FlexAttention with the block
    mask built from document ranges) against SDPA with the dense boolean mask, forward and
    backward; and its time against full causal attention on the same packed batch."""
    from autosp_lm.models.attention import document_mask, sdpa_attention
    if args.smoke:
        device, dtypes, seq, heads, docs = torch.device("cpu"), (torch.float32,), 256, 2, 8
    elif not torch.cuda.is_available():
        return [Row("packed_attention", "FlexAttention document mask", "skipped",
                    "no CUDA device")]
    else:
        device, dtypes, seq, heads, docs = torch.device("cuda"), (torch.bfloat16, torch.float32), \
            16384, 16, 8
    rows = []
    gen = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(seq - 1, generator=gen)[:docs - 1] + 1).values
    doc = torch.zeros(1, seq, dtype=torch.long)
    for c in cuts.tolist():
        doc[0, c:] += 1
    doc = doc.to(device)
    for dtype in dtypes:
        name = f"document mask {str(dtype).split('.')[-1]} S={seq}"
        if time.time() > deadline:
            rows.append(Row("packed_attention", name, "skipped", "time limit"))
            continue
        q, k, v = (torch.randn(1, heads, seq, 64, generator=gen).to(device, dtype)
                   .requires_grad_() for _ in range(3))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                             attn_mask=document_mask(doc)) \
            if seq <= 4096 else None
        grad_out = torch.randn(q.shape, generator=gen).to(device, dtype)

        def timed(fn):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn()
            out.backward(grad_out)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return out, time.perf_counter() - t

        if args.smoke:  # FlexAttention has no CPU backward: the dense-mask path of the entry point
            out, _ = timed(lambda: sdpa_attention(q, k, v, document_ids=doc))
        else:
            timed(lambda: sdpa_attention(q, k, v, document_ids=doc))  # compile
            for t in (q, k, v):
                t.grad = None
            out, masked_s = timed(lambda: sdpa_attention(q, k, v, document_ids=doc))
            for t in (q, k, v):
                t.grad = None
            timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            for t in (q, k, v):
                t.grad = None
            _, causal_s = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        if ref is None:  # too long for an fp64 dense reference: a masked SDPA in this dtype
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc))
        err = rel(out, ref)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        fig = {"max_err": err}
        note = "CPU: SDPA with the dense mask (FlexAttention has no CPU backward)" if args.smoke \
            else f"{docs} documents; masked {masked_s * 1e3:.1f} ms vs full causal " \
                 f"{causal_s * 1e3:.1f} ms (x{masked_s / causal_s:.2f})"
        if not args.smoke:
            fig["step_s"] = masked_s
        rows.append(Row("packed_attention", name, "ok" if err <= tol else "FAIL", note, **fig))
    return rows


# ============================================================================ optimizer paths
def section_optimizer(args, deadline) -> list:
    from autosp_lm.training.optimizer import apex_fused_adam, build_optimizer
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows = []
    torch.manual_seed(0)

    def one_step(opt_factory):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).to(device)
        torch.manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt = opt_factory(model)
        opt.step()
        return [p.detach().double().cpu() for p in model.parameters()]

    def reference(model):  # build_optimizer's hyper-parameters, the plain for-loop AdamW
        return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=0.0, foreach=False)

    torch.manual_seed(0)
    ref = one_step(reference)
    apex = apex_fused_adam()
    torch.manual_seed(0)
    got = one_step(lambda m: build_optimizer(m, lr=1e-2, weight_decay=0.0, device=device))
    err = max(rel(a, b) for a, b in zip(got, ref))
    path = ("apex FusedAdam" if apex is not None and device.type == "cuda"
            else "torch fused AdamW" if device.type == "cuda" else "torch AdamW")
    rows.append(Row("optimizer", f"build_optimizer ({path})", "ok" if err < 1e-5 else "FAIL",
                    "apex " + ("present" if apex is not None else "absent"), max_err=err))
    if apex is not None and device.type == "cuda":  # the absent path too
        torch.manual_seed(0)
        got = one_step(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                                   eps=1e-8, weight_decay=0.0, fused=True))
        err = max(rel(a, b) for a, b in zip(got, ref))
        rows.append(Row("optimizer", "torch fused AdamW (apex absent path)",
                        "ok" if err < 1e-5 else "FAIL", max_err=err))
    return rows


# ============================================================================ main
def section_fsdp(args, deadline) -> list:
    return gpu_check_fsdp.section_fsdp(args, deadline, run_worker, Row)


def section_recipes(args, deadline) -> list:
    return gpu_check_recipes.section_recipes(args, deadline, Row)


SECTIONS = [("attention_output_once", section_attention_output),
            ("attention_workspace", section_attention_workspace),
            ("ring_kernels", section_ring_kernels),
            ("packed_attention", section_packed_attention),
            ("optimizer", section_optimizer),
            ("plan_vs_measured", section_plan_vs_measured),
            ("peak_memory", section_peak_memory),
            ("simulated_sp", section_simulated_sp),
            ("simulated_2d", section_simulated_2d),
            ("fsdp", section_fsdp),
            ("recipes", section_recipes)]


def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "cuda_available": torch.cuda.is_available(), "cpu": platform.processor(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30,
                   flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
                   mem_efficient_sdp=torch.backends.cuda.mem_efficient_sdp_enabled(),
                   cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled())
    from autosp_lm.training.optimizer import apex_fused_adam
    env["apex"] = apex_fused_adam() is not None
    return env


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


def table(rows: list) -> str:
    keys = [k for k in ("max_err", "max_err_stock", "max_err_rewritten", "peak_mem_gib",
                        "predicted_gib", "peak_error", "step_error", "peak_live_gib",
                        "measured_mib", "predicted_mib", "host_mib",
                        "tokens_per_s", "tflops_per_device", "mfu", "step_s", "max_fit",
                        "first_oom") if any(k in r for r in rows)]
    lines = ["| section | check | status | " + " | ".join(keys) + " | note |",
             "|" + "---|" * (len(keys) + 4)]
    for r in rows:
        lines.append(f"| {r['section']} | {r['check']} | {r['status']} | "
                     + " | ".join(fmt(r.get(k)) for k in keys) + f" | {r.get('note', '')} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="gpu_check_out", help="directory for gpu_check.json/.md")
    p.add_argument("--time-limit", type=float, default=450,
                   help="seconds for the whole run (default 450: under 8 minutes)")
    p.add_argument("--smoke", action="store_true",
                   help="run the harness on CPU with tiny shapes (for CI; no GPU figures)")
    p.add_argument("--sections", default=",".join(n for n, _ in SECTIONS),
                   help="comma-separated subset of: " + ", ".join(n for n, _ in SECTIONS))
    args = p.parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.time_limit
    env = environment()
    rows = [Row("env", "torch / device", "ok", f"torch {env['torch']}, "
                + (env.get("device") or "no CUDA device") + f", apex {'yes' if env['apex'] else 'no'}")]
    wanted = set(args.sections.split(","))
    for name, fn in SECTIONS:
        if name not in wanted:
            continue
        try:
            rows += fn(args, deadline)
        except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
            rows.append(Row(name, "section", "FAIL", f"{type(e).__name__}: {e}"[:300]))
    text = table(rows)
    print(text, flush=True)
    os.makedirs(args.output, exist_ok=True)
    result = {"environment": env, "smoke": args.smoke, "seconds": time.time() - t0,
              "rows": rows}
    with open(os.path.join(args.output, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.output, "gpu_check.md"), "w") as f:
        f.write(f"GPU check, {env['time']}: torch {env['torch']}, "
                f"{env.get('device', 'CPU only')}{' (smoke run: no GPU figures)' if args.smoke else ''}"
                f", {result['seconds']:.0f} s\n\n{text}\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        cell = json.loads(sys.argv[2])
        workers = dict(gpu_check_fsdp.WORKERS, plan=plan_worker)
        out = workers.get(cell.get("worker"), simulated_worker)(cell)
        with open(sys.argv[3], "w") as f:
            json.dump(out, f)
    else:
        res = main()
        sys.exit(1 if any(r["status"] == "FAIL" for r in res["rows"]) else 0)
