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
  and the longest context per GPU of Ulysses (plain and with full recomputation), AutoSP
  without SAC, AutoSP, AutoSP with activation offload and the max-context mode (without and
  with offload), as one rank of an 8-way SP job on ``llama-3.2-1b`` in bf16 (fake process
  group, like ``simulated_sp``), with each one's max context relative to the strongest
  hand-written recipe that ran;
* ``plan_vs_measured``: the memory planner (``tools/plan_memory.py``) against the GPU: its
  prediction of one rank's peak (traced on fake tensors on the CPU, no GPU used) next to
  ``torch.cuda.max_memory_allocated`` of the same compiled program run for real on the GPU as
  one rank of an 8-way SP job (fake process group), for ``none``, ``autosp`` and ``ulysses`` on
  ``llama-3.2-1b`` in bf16 at 8K tokens, and ``autosp`` with its parameters sharded over the 8
  ranks by graph FSDP (``--use-torch-fsdp2``; the planner traces the sharded step), and the
  same for the max-context mode (``--max-context``, planner ``autosp-max``) without and with
  the offload of its layer inputs, whose pinned host bytes are compared too; error of
  the whole peak and of the step's part (the planner's CPU validation tolerance, 10%). The
  measured program is the planner's (AutoSP on aot_eager, the others op by op): Inductor's fused
  kernels allocate less (``peak_memory``);
* ``optimizer``: one AdamW step through the apex ``FusedAdam`` path when apex is built and the
  torch fused path otherwise (both when possible), against a float64 reference;
* ``fsdp``: sharded model state (``autosp_lm/bench/gpu/fsdp.py``): peak memory, model-state bytes and
  step time of one simulated rank of an 8-way job with ``--use-torch-fsdp2`` (native FSDP2 under
  ``--ulysses``, graph FSDP under ``--autosp``) and ``--use-distributed-optimizer`` against
  unsharded; torch's fused AdamW on DTensor parameters; ``dcp.async_save`` of CUDA state.

No network and no wandb are needed. ``--time-limit`` bounds the whole run (sections that do not
fit are reported as skipped, never silently dropped). ``--smoke`` runs the same code on CPU with
tiny shapes (llama-tiny, 2-way simulated SP, aot_eager) so that the harness is tested in CI.
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
    p.add_argument("--time-limit", type=float, default=450,
                   help="seconds for the whole run (default 450: under 8 minutes)")
    p.add_argument("--smoke", action="store_true",
                   help="run the harness on CPU with tiny shapes (for CI; no GPU figures)")
    p.add_argument("--sections", default=",".join(n for n, _ in SECTIONS),
                   help="comma-separated subset of: " + ", ".join(n for n, _ in SECTIONS))
    args = p.parse_args(argv)
    return report.run(args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:  # the workers run autosp_lm.bench.gpu.worker
        worker.main(sys.argv[2:])
    else:
        res = main()
        sys.exit(1 if any(r["status"] == "FAIL" for r in res["rows"]) else 0)
