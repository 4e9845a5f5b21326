#!/usr/bin/env python
"""Benchmark an AutoSP plan against the gather fallback it replaces, and against one device.

Decoders (written unlike our models, from tests/helpers/decoders/):

* ``moe``: the token-routed MoE decoder; the plan routes each rank's own tokens, the fallback
  (``refuse_plans=("rows",)``) gathers the whole sequence at the sorts and every rank runs the MoE
  block on all tokens.
* ``mixtral``: transformers' ``MixtralForCausalLM`` (a tiny config of ``--dim``, ``--layers``,
  ``--experts``, ``--k``, with the router's load-balancing loss) on its default experts path
  (``grouped_mm``: sort, ``histc`` group offsets, a grouped matmul custom op); the plan runs each
  rank's own tokens through it, the fallback (``refuse_plans=("rows",)``) gathers them, as
  AutoSP did before the grouped kernel was registered. Needs ``transformers``.
* ``ssm``: a hybrid of Mamba-2-style chunked-scan blocks and causal attention blocks
  (``HybridSSD``); the plan keeps the chunks sharded for the work within a chunk and runs the
  recurrence across chunks head-parallel (all-to-alls, 1/P of the heads); the middle variant
  (``refuse_plans=("heads",)``) gathers the chunk-level states for that recurrence instead, the
  fallback (``refuse_plans=("blocks", "heads")``) gathers X, B, C and the step sizes and runs the
  scan on the whole sequence on every rank.
* ``delta``: the gated delta rule (Gated DeltaNet's linear attention, ``DeltaNet``), each delta
  block followed by causal attention; the same three variants (the middle one gathers the
  per-chunk values for its loop over the chunks).

Each variant runs on ``--world`` local gloo ranks with the same weights and batch; the one-device
run (``--one-device``) compiles the same model with the same backend on one process. Per run:
median step time (forward + backward, after one warm-up step), bytes saved for backward per
local token (once per storage, parameters excluded), the peak of live tensor memory of one step
(``LivePeak``: the CPU allocator's running total), the collectives of one step and the
fallbacks; then the ratios.

    python tools/bench_autosp_plans.py --decoder ssm --seq-length 8192 --steps 2 \\
        --one-device --out docs/bench/cpu_ssm_autosp_8k
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

from autosp_lm.config.shared_flags import add_seq_length, add_sequence_parallel_size  # noqa: E402
from autosp_lm.parallel.spawn import run_local  # noqa: E402

_SCAN_VARIANTS = (("plan", ()), ("gathered recurrence", ("heads",)),
                  ("fallback", ("blocks", "heads")))
VARIANTS = {"moe": (("plan", ()), ("fallback", ("rows",))),
            "mixtral": (("plan", ()), ("fallback", ("rows",))), "ssm": _SCAN_VARIANTS,
            "delta": _SCAN_VARIANTS}
TITLES = {"plan": "AutoSP plan", "fallback": "gather fallback",
          "gathered recurrence": "blocks, recurrence gathered (no head-parallel)"}


class _LossOf(torch.nn.Module):
    """A transformers causal LM as ``(input_ids, labels) -> loss``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def _model(args):
    if args["decoder"] == "mixtral":
        import transformers as tf
        torch.manual_seed(0)
        d = args["dim"]
        cfg = tf.MixtralConfig(hidden_size=d, intermediate_size=2 * d,
                               num_hidden_layers=args["layers"], num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=args["experts"],
                               num_experts_per_tok=args["k"], output_router_logits=True,
                               router_aux_loss_coef=0.01, vocab_size=args["vocab"],
                               max_position_embeddings=args["seq"], attn_implementation="sdpa",
                               use_cache=False)
        return _LossOf(tf.MixtralForCausalLM(cfg))
    if args["decoder"] == "moe":
        from tests.helpers.decoders.moe_style import MoELM
        torch.manual_seed(0)
        return MoELM(vocab=args["vocab"], dim=args["dim"], layers=args["layers"],
                     experts=args["experts"], k=args["k"], hidden=args["dim"] * 2)
    if args["decoder"] == "delta":
        from tests.helpers.decoders.delta_style import DeltaNet
        return DeltaNet(vocab=args["vocab"], dim=args["dim"], heads=args["heads"],
                        chunk=args["chunk"], layers=args["layers"] // 2)
    from tests.helpers.decoders.ssd_style import HybridSSD
    return HybridSSD(vocab=args["vocab"], dim=args["dim"], layers=args["layers"],
                     heads=args["heads"], state=args["state"], chunk=args["chunk"])


def _measure(step, ids, model, steps, world):
    from autosp_lm.training.memory import LivePeak, SavedTensorBytes
    times, saved = [], None
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        with SavedTensorBytes(exclude=model) as m:
            loss = step()
        loss.backward()
        if i:  # step 0 compiles
            times.append(time.perf_counter() - t)
        saved = m.bytes
    model.zero_grad(set_to_none=True)
    with LivePeak() as peak:
        step().backward()
    return {"loss": loss.item(), "step_s": statistics.median(times) if times else None,
            "saved_per_local_token": saved / (ids.numel() / world), "peak_live": peak.peak}


def _worker(rank, world, args):
    from autosp_lm.compiler import autosp_compile
    out = {}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)
    for name, refuse in VARIANTS[args["decoder"]]:
        torch._dynamo.reset()
        model = _model(args)
        run = autosp_compile(model, backend=args["backend"], sac=False, verbose=False,
                             refuse_plans=refuse)
        out[name] = _measure(lambda: run(input_ids=ids, labels=ids), ids, model, args["steps"],
                             world)
        rep = run.report.as_dict()
        out[name].update(collectives_forward=rep["collectives_forward"],
                         collectives_backward=rep["collectives_backward"],
                         fallbacks=[f["op"] for f in rep["fallbacks"]])
    return out


def _one_device(args):
    torch._dynamo.reset()
    model = _model(args)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)
    compiled = torch.compile(model, backend=args["backend"])
    return _measure(lambda: compiled(ids, ids), ids, model, args["steps"], 1)


def _row(name, r, base=None):
    def ratio(k):
        return f" (x{r[k] / base[k]:.2f})" if base and base.get(k) and r.get(k) else ""
    step = f"{r['step_s']:.3f} s" if r["step_s"] is not None else "-"
    return (f"| {name} | {step}{ratio('step_s')} | {r['saved_per_local_token']:.0f} B"
            f"{ratio('saved_per_local_token')} | {r['peak_live'] / 2**20:.1f} MiB"
            f"{ratio('peak_live')} | {sum(r.get('collectives_forward', {}).values())} | "
            f"{len(r.get('fallbacks', []))} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decoder", default="moe", choices=sorted(VARIANTS), help="the model code")
    add_sequence_parallel_size(p, 2, help="sequence-parallel ranks (gloo)", flags=("--world",))
    add_seq_length(p, 2048)
    p.add_argument("--batch", type=int, default=1, help="samples per step")
    p.add_argument("--layers", type=int, default=2, help="decoder blocks (delta: delta + "
                   "attention pairs count as two)")
    p.add_argument("--dim", type=int, default=64, help="hidden size")
    p.add_argument("--experts", type=int, default=8, help="moe: experts per MoE block")
    p.add_argument("--k", type=int, default=2, help="moe: experts per token (top-k routing)")
    p.add_argument("--heads", type=int, default=4, help="ssm: heads of the scan and attention")
    p.add_argument("--state", type=int, default=16, help="ssm: state size per head")
    p.add_argument("--chunk", type=int, default=64, help="ssm: chunk length of the scan")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"),
                   help="code generation of the compiled model")
    p.add_argument("--one-device", action="store_true", help="also run the model on one process")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = p.parse_args(argv)
    args = dict(decoder=a.decoder, seq=a.seq_length, batch=a.batch, layers=a.layers, dim=a.dim,
                experts=a.experts, k=a.k, heads=a.heads, state=a.state, chunk=a.chunk,
                vocab=a.vocab, steps=a.steps, backend=a.backend)
    res = run_local(_worker, a.world, args, timeout=3600)[0]
    plan, fb = res["plan"], res["fallback"]
    one = _one_device(args) if a.one_device else None
    summary = {"config": dict(args, world=a.world), "plan": plan, "fallback": fb,
               "variants": res, "one_device": one,
               "step_time_ratio_fallback_over_plan": fb["step_s"] / plan["step_s"],
               "saved_bytes_ratio_fallback_over_plan":
                   fb["saved_per_local_token"] / plan["saved_per_local_token"],
               "peak_live_ratio_fallback_over_plan": fb["peak_live"] / plan["peak_live"],
               "same_loss": abs(plan["loss"] - fb["loss"]) <= 1e-5 * abs(fb["loss"])}
    what = {"moe": f"MoE decoder ({a.layers} layers, {a.experts} experts, top-{a.k}, dim {a.dim})",
            "mixtral": f"transformers' MixtralForCausalLM, default grouped_mm experts ({a.layers} "
                       f"layers, {a.experts} experts, top-{a.k}, hidden {a.dim}, router aux loss)",
            "ssm": f"hybrid chunked-scan + attention decoder ({a.layers} layers, dim {a.dim}, "
                   f"{a.heads} heads, state {a.state}, chunk {a.chunk})",
            "delta": f"hybrid gated-delta-rule + attention decoder ({a.layers} layers, dim "
                     f"{a.dim}, {a.heads} heads, chunk {a.chunk})"}[a.decoder]
    head = (f"{what}, S={a.seq_length}, SP {a.world}, {a.backend}, CPU. Ratios in parentheses "
            f"are against the AutoSP plan.")
    rows = [_row(TITLES[name], res[name], None if name == "plan" else plan)
            for name, _ in VARIANTS[a.decoder]]
    if one is not None:
        rows.append(_row("one device", one, plan))
    table = ("| run | step time | saved / local token | peak live | collectives / step | "
             "fallbacks |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(json.dumps(summary, indent=1))
    print(head)
    print(table)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        cmd = " ".join(["python tools/bench_autosp_plans.py"] + (argv if argv is not None
                                                                  else sys.argv[1:]))
        with open(a.out + ".md", "w") as f:
            f.write(f"# AutoSP plan vs gather fallback: {what}\n\n`{cmd}`\n\n{head}\n\n"
                    "Step time: median of forward + backward after a warm-up step. Saved: bytes "
                    "saved for backward per local token. Peak live: tensor memory of one step "
                    "above its start (one rank). CPU timings on a shared 2-core machine: read the "
                    "ratios, not the seconds.\n\n" + table)
    return summary


if __name__ == "__main__":
    main()
