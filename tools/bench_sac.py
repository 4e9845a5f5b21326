#!/usr/bin/env python
"""Benchmark sequence-aware activation checkpointing (SAC) on one device.

For each model: the same ``torch.compile`` with and without SAC, at one sequence length; median
step time (forward + backward, after warm-up) and bytes saved for backward per token (counted once
per storage with saved-tensor hooks, parameters excluded), and the ratios. Also the peak RSS
growth of one step (CPU) or the CUDA allocator peak.

    python tools/bench_sac.py --models llama-tiny gpt-tiny --seq-length 8192 --steps 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autosp_lm.config.cli import RawDescriptionHelpFormatter  # noqa: E402
from autosp_lm.config.shared_flags import add_seq_length  # noqa: E402
from autosp_lm.compiler import sac_compile  # noqa: E402
from autosp_lm.training.memory import SavedTensorBytes, cuda_peak_delta, peak_rss_delta  # noqa: E402
from autosp_lm.models import build_model, preset_config  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Variant:
    """One compiled copy of the model (same weights and batch as the other variant)."""

    def __init__(self, name, seq, batch, sac, budget, backend, device):
        torch.manual_seed(0)
        self.sac = sac
        self.model = build_model(preset_config(name)).to(device)
        self.ids = torch.randint(0, self.model.config.vocab_size, (batch, seq),
                                 generator=torch.Generator().manual_seed(1)).to(device)
        self.fn = sac_compile(self.model, budget=budget, backend=backend) if sac else \
            torch.compile(self.model, backend=backend)
        self.device = device
        self.times: list = []
        self.cpu_times: list = []

    def step(self):
        self.model.zero_grad(set_to_none=True)
        loss = self.fn(self.ids, labels=self.ids)
        loss.backward()
        return loss

    def timed_step(self):
        _sync(self.device)
        t, c = time.perf_counter(), time.process_time()
        self.step()
        _sync(self.device)
        self.times.append(time.perf_counter() - t)
        self.cpu_times.append(time.process_time() - c)

    def measure_memory(self):
        with SavedTensorBytes(exclude=self.model) as mem:
            loss = self.fn(self.ids, labels=self.ids)
        loss.backward()
        self.saved_bytes = mem.bytes
        self.loss = float(loss.detach())
        if self.device.type == "cuda":
            _, self.peak = cuda_peak_delta(self.step)
        else:
            _, self.peak = peak_rss_delta(self.step)


def bench_model(name, seq, steps, warmup, budget, backend, device, batch) -> dict:
    torch._dynamo.reset()
    base = Variant(name, seq, batch, False, budget, backend, device)
    sac = Variant(name, seq, batch, True, budget, backend, device)
    for v in (base, sac):
        t0 = time.perf_counter()
        v.step()
        _sync(device)
        v.compile_s = time.perf_counter() - t0
        for _ in range(max(0, warmup - 1)):
            v.step()
        v.measure_memory()
    # Interleave the timed steps so that load from other processes hits both alike.
    for _ in range(steps):
        base.timed_step()
        sac.timed_step()
    tb, ts = statistics.median(base.times), statistics.median(sac.times)
    st = sac.fn.sac_stats[-1] if sac.fn.sac_stats else {}
    return dict(model=name, seq=seq, batch=batch, backend=backend, device=str(device),
                budget=budget, step_s_base=tb, step_s_sac=ts, time_ratio=ts / tb,
                min_step_s_base=min(base.times), min_step_s_sac=min(sac.times),
                min_time_ratio=min(sac.times) / min(base.times),
                step_times_base=base.times, step_times_sac=sac.times,
                cpu_s_base=statistics.median(base.cpu_times),
                cpu_s_sac=statistics.median(sac.cpu_times),
                cpu_time_ratio=statistics.median(sac.cpu_times) / statistics.median(base.cpu_times),
                saved_bpt_base=base.saved_bytes / (seq * batch),
                saved_bpt_sac=sac.saved_bytes / (seq * batch),
                saved_reduction=base.saved_bytes / max(sac.saved_bytes, 1),
                peak_delta_base=base.peak, peak_delta_sac=sac.peak,
                compile_s_base=base.compile_s, compile_s_sac=sac.compile_s,
                loss_base=base.loss, loss_sac=sac.loss,
                sac_stats={k: st.get(k) for k in (
                    "budget", "nodes_forward", "nodes_recomputed", "nodes_saved",
                    "saved_bytes_per_token", "recompute_fraction", "attention_flops",
                    "step_flops", "seconds")})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama-tiny", "gpt-tiny"], help="model presets")
    add_seq_length(p, 8192)
    p.add_argument("--batch-size", type=int, default=1, help="samples per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    p.add_argument("--budget", type=float, default=0.1, help="SAC recompute budget (--sac-recompute-budget)")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"],
                   help="torch.compile backend of both runs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to run on")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    results = []
    for name in args.models:
        row = bench_model(name, args.seq_length, args.steps, args.warmup, args.budget,
                          args.backend, device, args.batch_size)
        results.append(row)
        mb = lambda v: "n/a" if v is None else f"{v / 2**20:.1f} MiB"  # noqa: E731
        print(f"{name} seq={args.seq_length} {args.backend} {device}: "
              f"step {row['step_s_base']:.3f}s -> {row['step_s_sac']:.3f}s "
              f"(x{row['time_ratio']:.3f}; fastest step x{row['min_time_ratio']:.3f}; "
              f"process CPU time x{row['cpu_time_ratio']:.3f}); saved/token {row['saved_bpt_base']:.0f} B -> "
              f"{row['saved_bpt_sac']:.0f} B ({row['saved_reduction']:.1f}x fewer); "
              f"peak step growth {mb(row['peak_delta_base'])} -> {mb(row['peak_delta_sac'])}; "
              f"recompute {100 * (row['sac_stats'] or {}).get('recompute_fraction', 0):.1f}% of step FLOPs",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
