#!/usr/bin/env python
"""Benchmark AutoSP on a token-routed MoE decoder: the routing plan (each rank routes its own
tokens; only the aux loss's counts are reduced) against the gather fallback (the same compile
with ``refuse_plans=("rows",)``: the sorts gather the whole sequence and every rank runs the
MoE block on all tokens).

Both variants run on ``--world`` local gloo ranks with the same weights and batch; per variant:
median step time (forward + backward, after one warm-up step), bytes saved for backward per
local token (once per storage, parameters excluded), the collectives of one step and the
fallbacks, and the ratios fallback / plan. The decoder is the MoE test decoder
(tests/helpers/decoders/moe_style.py, written unlike our models).

    python tools/bench_autosp_moe.py --seq-length 2048 --steps 3 --out docs/bench/cpu_moe_autosp
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autosp_lm.parallel.spawn import run_local  # noqa: E402

VARIANTS = {"plan": (), "fallback": ("rows",)}


def _worker(rank, world, args):
    from autosp_lm.compiler import autosp_compile
    from autosp_lm.training.memory import SavedTensorBytes
    from tests.helpers.decoders.moe_style import MoELM
    out = {}
    for name, refuse in VARIANTS.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MoELM(vocab=args["vocab"], dim=args["dim"], layers=args["layers"],
                      experts=args["experts"], k=args["k"], hidden=args["dim"] * 2)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)
        run = autosp_compile(model, backend=args["backend"], sac=False, verbose=False,
                             refuse_plans=refuse)
        times, saved = [], None
        for step in range(args["steps"] + 1):
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            with SavedTensorBytes(exclude=model) as m:
                loss = run(input_ids=ids, labels=ids)
            loss.backward()
            if step:  # step 0 compiles
                times.append(time.perf_counter() - t)
                saved = m.bytes
        rep = run.report.as_dict()
        out[name] = {"loss": loss.item(), "step_s": statistics.median(times),
                     "saved_per_local_token": saved / (ids.numel() / world),
                     "collectives_forward": rep["collectives_forward"],
                     "collectives_backward": rep["collectives_backward"],
                     "fallbacks": [f["op"] for f in rep["fallbacks"]]}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="sequence-parallel ranks (gloo)")
    p.add_argument("--seq-length", type=int, default=2048, help="tokens per sample")
    p.add_argument("--batch", type=int, default=1, help="samples per step")
    p.add_argument("--layers", type=int, default=2, help="decoder blocks")
    p.add_argument("--dim", type=int, default=64, help="hidden size")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE block")
    p.add_argument("--k", type=int, default=2, help="experts per token (top-k routing)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"),
                   help="code generation of the compiled model")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = p.parse_args(argv)
    args = dict(seq=a.seq_length, batch=a.batch, layers=a.layers, dim=a.dim, experts=a.experts,
                k=a.k, vocab=a.vocab, steps=a.steps, backend=a.backend)
    res = run_local(_worker, a.world, args, timeout=3600)[0]
    plan, fb = res["plan"], res["fallback"]
    summary = {"config": dict(args, world=a.world), "plan": plan, "fallback": fb,
               "step_time_ratio_fallback_over_plan": fb["step_s"] / plan["step_s"],
               "saved_bytes_ratio_fallback_over_plan":
                   fb["saved_per_local_token"] / plan["saved_per_local_token"],
               "same_loss": abs(plan["loss"] - fb["loss"]) <= 1e-5 * abs(fb["loss"])}
    line = (f"| MoE decoder ({a.layers} layers, {a.experts} experts, top-{a.k}, dim {a.dim}), "
            f"S={a.seq_length}, SP {a.world}, {a.backend}, CPU | "
            f"{plan['step_s']:.3f} s / {fb['step_s']:.3f} s "
            f"(x{summary['step_time_ratio_fallback_over_plan']:.2f}) | "
            f"{plan['saved_per_local_token']:.0f} B / {fb['saved_per_local_token']:.0f} B "
            f"(x{summary['saved_bytes_ratio_fallback_over_plan']:.2f}) | "
            f"{', '.join(fb['fallbacks']) or '-'} |")
    print(json.dumps(summary, indent=1))
    print(line)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write("# AutoSP on a token-routed MoE decoder: routing plan vs gather fallback\n\n"
                    f"`python tools/bench_autosp_moe.py --seq-length {a.seq_length} --steps "
                    f"{a.steps} --world {a.world} --backend {a.backend}`\n\n"
                    "Step time (median, forward + backward) and bytes saved for backward per "
                    "local token: plan / fallback (fallback / plan). CPU timings on a shared, "
                    "loaded machine: read the ratios, not the seconds.\n\n"
                    "| case | step time | saved / local token | fallback ops |\n"
                    "|---|---|---|---|\n" + line + "\n")
    return summary


if __name__ == "__main__":
    main()
