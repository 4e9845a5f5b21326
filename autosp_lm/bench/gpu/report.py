"""The GPU check's run: its sections in order, the environment, the table, and
``gpu_check.json`` / ``gpu_check.md``."""
from __future__ import annotations

import json
import os
import platform
import time

import torch

from .attention import section_attention_output, section_attention_workspace
from .common import Row
from .fsdp import section_fsdp
from .kernels import section_packed_attention, section_ring_kernels
from .optimizer import section_optimizer
from .plan_check import section_plan_vs_measured
from .recipes import section_recipes
from .simulated import section_peak_memory, section_simulated_2d, section_simulated_sp

#: the sections in the order they run: (name, function(args, deadline) -> rows)
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
    """torch, Python, the device and its SDPA kernels, apex."""
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
    """A figure of the table: floats to 3 significant digits, empty where missing."""
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


def table(rows: list) -> str:
    """The Markdown table of ``rows``: the figure columns some row has, in a fixed order."""
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


def run(args) -> dict:
    """Every section of ``args.sections`` within ``args.time_limit`` (``args.smoke``: on CPU,
    tiny shapes); prints the table, writes ``gpu_check.json`` and ``gpu_check.md`` under
    ``args.output`` and returns what the JSON holds."""
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
