#!/usr/bin/env python
"""The GPU check: one command that runs the CUDA paths no CPU test can, the decisive figures
first, and writes them to JSON and Markdown for docs/bench/ after every cell.

    python tools/gpu_check.py --output docs/bench/gpu_check        # one H100: under 10 minutes
    python tools/gpu_check.py --smoke --output /tmp/gpu_check      # CPU: the harness itself

It has not run on a GPU yet: there are no GPU figures (docs/bench/README.md). Without a CUDA device
(and without ``--smoke``) it says so, writes "not run" and exits with status 2.

The sections, in the order they run (estimated seconds on one H100 in brackets: how they were
estimated is in ``autosp_lm/bench/gpu/decisive.py``; every row records what it took, ``cell_s``):

1. ``plan_vs_measured`` [~120 s a cell, side by side: ~250 s in all]: the decisive cells. For each
   recipe of ``decisive.DECISIVE`` (``autosp``, ``autosp-max``, ``autosp-max-offload``,
   ``ulysses+ac``, ``ulysses+alst``, ``ulysses+upipe``; a name this tree does not have is
   "skipped: not in this tree"), the memory planner's prediction of one rank's peak and pinned host
   bytes (a trace on fake tensors on the CPU) against ``torch.cuda.max_memory_allocated`` and the
   host bytes of the same compiled program run for real: ``llama-3.2-1b``, bf16, one rank of an
   8-way job (fake process group), 64K tokens, SP 8, AutoSP's recipes with the model state
   sharded by graph FSDP (``--use-torch-fsdp2``, traced by the planner), the hand-written ones
   unsharded (the planner only bounds native FSDP2); the whole peak, the forward/backward
   phase's peak and the host bytes, each within the planner's 10% tolerance;
2. ``throughput`` [~180 s compiling side by side, then ~15 s a recipe timed alone]: tokens/s,
   TFLOP/s per device and MFU of the same recipes in the same job with ``--use-torch-fsdp2``, as
   users run them (Inductor; the ALST recipe eagerly with its host offload);
3. ``attention_workspace`` [~10 s]: the planner's formula for the FlashAttention-2 backward's own
   scratch (``autosp_lm/planner/workspace.py``) against the kernel, MHA and GQA shapes;
4. ``recipes`` [~60 s]: the hand-written strategies' memory techniques on one GPU, the ALST
   offload's CUDA stream path (its gradients against full recomputation, its host bytes);
5. ``attention_output_once`` [~20 s]: the AutoSP joint-graph pass on the flash, memory-efficient
   and cuDNN SDPA backward kernels in bf16 and fp16 (gradients as exact as the stock kernel's);
6. ``ring_kernels`` [~10 s]: ring attention's CUDA block kernels against fp64 math;
7. ``optimizer`` [~5 s]: AdamW through apex ``FusedAdam`` / torch fused against fp64;
8. ``packed_attention`` [~30 s]: document-masked attention (FlexAttention) against SDPA with the
   dense mask, and its time against full causal attention;
9. ``peak_memory`` [~300 s a recipe]: the longest context per GPU measured (doubling, then
   bisecting): the max-context mode with and without offload, ``ulysses+alst``,
   ``ulysses+upipe``, ``autosp-max``, ``ulysses+ac``, AutoSP's default plan and offload, plain
   Ulysses and AutoSP without SAC, one rank of 8 on ``llama-3.2-1b`` in bf16;
10. ``fsdp`` [~810 s]: sharded model state of one simulated rank of 8 (native FSDP2 under
    ``--ulysses``, graph FSDP under ``--autosp``, the distributed optimizer) against unsharded;
    fused AdamW on DTensor shards; ``dcp.async_save`` of CUDA state;
11. ``simulated_2d`` [~200 s a plan]: AutoSP's Ulysses x ring plans at SP 8 (8x1, 4x2, 2x4);
12. ``plan_vs_measured_baselines`` [~120 s]: the planner against the device for ``none`` and
    plain ``ulysses`` at 8K tokens;
13. ``simulated_sp`` [~240 s a strategy]: ``--autosp`` and ``--ulysses`` at 8K and 32K tokens and
    the longest sequence that fits.

By these estimates, in the default 540 s on one H100 80 GB: ``plan_vs_measured`` ends at about
250 s (the three AutoSP cells, ~8 GiB each under graph FSDP, and one unsharded hand-written cell,
~24 GiB, start together within 70% of the device's memory, the other two as room frees; on an
H200 all six at once, about 130 s), ``throughput`` at about 500 s (six workers, ~10 GiB each,
compile together, then each is timed alone), and the sections after it get what is left; ``--sections`` with a larger ``--time-limit`` runs the others (e.g.
``--sections peak_memory --time-limit 1500``). A cell whose estimate does not fit the
time left is recorded as skipped (with its estimate) and the later, cheaper ones still run; a cell
that fails (an OOM, a crash: each worker cell is its own process) is a FAIL row with its error and
the run goes on; ``gpu_check.json`` / ``gpu_check.md`` are rewritten after every row, so a run that
is killed keeps what it measured (``complete: false``, the section it was in). No network and no
wandb are needed. ``--smoke`` runs the same code on CPU with tiny shapes (llama-tiny, 2-way
simulated SP, aot_eager) so that the harness is tested in CI.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from autosp_lm.bench.gpu import report, worker  # noqa: E402
from autosp_lm.bench.gpu.report import SECTIONS  # noqa: E402

WORKER_FLAG = "--worker"


def main(argv: Optional[list] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="gpu_check_out", help="directory for gpu_check.json/.md")
    p.add_argument("--time-limit", type=float, default=540,
                   help="seconds for the sections (default 540: 9 minutes, for a 10-minute slot "
                        "with start-up and the last cell's overrun)")
    p.add_argument("--smoke", action="store_true",
                   help="run the harness on CPU with tiny shapes (for CI; no GPU figures)")
    p.add_argument("--sections", default=",".join(n for n, _ in SECTIONS),
                   help="comma-separated subset of: " + ", ".join(n for n, _ in SECTIONS))
    args = p.parse_args(argv)
    unknown = sorted(set(filter(None, args.sections.split(","))) - {n for n, _ in SECTIONS})
    if unknown:
        p.error(f"--sections: unknown {', '.join(unknown)}; choose from "
                + ", ".join(n for n, _ in SECTIONS))
    if not args.time_limit > 0:
        p.error(f"--time-limit {args.time_limit:g} must be a positive number of seconds")
    return report.run(args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:  # the workers run autosp_lm.bench.gpu.worker
        worker.main(sys.argv[2:])
    else:
        res = main()
        sys.exit(2 if res.get("not_run") else
                 1 if any(r["status"] == "FAIL" for r in res["rows"]) else 0)
