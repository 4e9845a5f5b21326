#!/usr/bin/env python
"""Bytes AutoSP's SAC keeps for the backward per local token per layer, Megatron-style ``--bf16``
(bf16 parameters: bf16 residual stream) against ``--bf16 --fp32-residual-connection`` (fp32
parameters under autocast) and fp32, on real gloo ranks (CPU).

Each rank compiles the model with ``--autosp`` (SAC on, Inductor unless ``--backend aot_eager``),
runs one step and reads SAC's saved bytes from its report; the per-token-per-layer figure divides
by the rank's tokens and the model's layers. Writes a JSON and a markdown table.

    python tools/bf16_saved_bytes.py --model llama-tiny --seq-length 4096 --nproc 2 \\
        --output docs/bench/bf16_saved_bytes
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODES = {"fp32": dict(bf16=False, fp32_residual=False),
         "bf16 --fp32-residual-connection": dict(bf16=True, fp32_residual=True),
         "bf16 (Megatron-style)": dict(bf16=True, fp32_residual=False)}


def worker(rank, world, model_name, seq, layers, backend, offload):
    import torch

    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel.sharding import Sharding
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy
    torch.set_num_threads(1)
    out = {}
    cfg = preset_config(model_name, **({"num_layers": layers} if layers else {}),
                        max_position_embeddings=max(seq, 16384))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1),
             "position_ids": torch.arange(seq)[None]}
    for name, mode in MODES.items():
        torch._dynamo.reset()
        ps = init_parallel(world)
        torch.manual_seed(0)
        model = build_model(cfg)
        Sharding(ps, **mode).wrap(model)
        strategy = build_strategy("autosp", ps, sac=True, backend=backend, verbose=False,
                                  offload_activations=offload)
        strategy.setup(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode["bf16"]):
            loss, reported = strategy.forward_loss(batch)
        loss.backward()
        sac = strategy.runner.report.as_dict()["sac"]
        local = seq // world
        out[name] = dict(loss=reported.item(), saved_bytes=sac["saved_bytes"],
                         per_token_per_layer=sac["saved_bytes"] / local / cfg.num_layers,
                         per_token_per_layer_per_hidden=sac["saved_bytes"] / local
                         / cfg.num_layers / cfg.hidden_size,
                         saved_bytes_no_recompute=sac.get("saved_bytes_no_recompute"))
    return out


def main(argv=None):
    from autosp_lm.config.cli import RawDescriptionHelpFormatter
    from autosp_lm.config.shared_flags import add_model, add_seq_length, add_sequence_parallel_size
    from autosp_lm.parallel.spawn import run_local
    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    add_model(p, "llama-tiny", help="model preset")
    p.add_argument("--num-layers", type=int, default=0, help="override the preset's layers")
    add_seq_length(p, 4096, help="tokens of the one batch")
    add_sequence_parallel_size(p, 2, help="gloo ranks (the SP size)", flags=("--nproc",))
    p.add_argument("--backend", choices=["inductor", "aot_eager"], default="inductor",
                   help="AutoSP's code generation")
    p.add_argument("--offload-activations", action="store_true",
                   help="AutoSP's --offload-activations too")
    p.add_argument("--output", default="bf16_saved_bytes", help="path prefix of .json/.md")
    a = p.parse_args(argv)
    res = run_local(worker, a.nproc, a.model, a.seq_length, a.num_layers, a.backend,
                    a.offload_activations, timeout=3600)[0]
    rows = ["| mode | saved bytes (rank 0) | B / local token / layer | B / token / layer / hidden "
            "| loss |", "|---|---|---|---|---|"]
    for name, r in res.items():
        rows.append(f"| {name} | {r['saved_bytes']:,} | {r['per_token_per_layer']:.1f} | "
                    f"{r['per_token_per_layer_per_hidden']:.2f} | {r['loss']:.5f} |")
    base = res["bf16 --fp32-residual-connection"]["saved_bytes"]
    ratio = res["bf16 (Megatron-style)"]["saved_bytes"] / base
    text = (f"AutoSP (SAC on, {a.backend}{', --offload-activations' if a.offload_activations else ''}"
            f") saved bytes for the backward, {a.model}, {a.seq_length} tokens on {a.nproc} gloo "
            f"ranks (CPU), one step:\n\n" + "\n".join(rows)
            + f"\n\nMegatron-style bf16 / fp32-residual bf16: {ratio:.3f}\n\n"
            f"`python tools/bf16_saved_bytes.py --model {a.model} --seq-length {a.seq_length} "
            f"--nproc {a.nproc}{' --offload-activations' if a.offload_activations else ''}`\n")
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    with open(a.output + ".json", "w") as f:
        json.dump({"args": vars(a), "results": res, "ratio": ratio}, f, indent=1)
    with open(a.output + ".md", "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
