"""The GPU check's run: its sections in order, the environment, the table, and
``gpu_check.json`` / ``gpu_check.md``, rewritten (atomically) after every row, so a run that is
killed keeps every cell it finished."""
from __future__ import annotations

import json
import os
import platform
import signal
import time

import torch

from ...data.cache import atomic_write_text
from .attention import section_attention_output, section_attention_workspace
from .autosp_kernels import section_autosp_kernels
from .common import Row, kill_workers
from .decisive import section_throughput
from .fsdp import section_fsdp
from .kernels import section_packed_attention, section_ring_kernels
from .memory_plan import section_memory_plan
from .optimizer import section_optimizer
from .plan_check import section_plan_vs_measured, section_plan_vs_measured_baselines
from .recipes import section_recipes
from .simulated import section_peak_memory, section_simulated_2d, section_simulated_sp

#: the sections in the order they run, the most decisive first: (name, function(args,
#: deadline) -> rows, an iterable: a generator's rows are written as they come). The first two
#: are the decisive cells (decisive.py): the planner against the device for each recipe, then
#: each recipe's tokens/s and MFU. Then what explains or guards them, cheap first: the planner's
#: CUDA workspace formula, the ALST offload's CUDA path, the AutoSP pass and ring attention on
#: the CUDA kernels (AutoSP's on the kernels a GPU run executes), the fused optimizer, packed attention; then the long searches and the rest.
SECTIONS = [("plan_vs_measured", section_plan_vs_measured),
            ("throughput", section_throughput),
            ("attention_workspace", section_attention_workspace),
            ("recipes", section_recipes),
            ("attention_output_once", section_attention_output),
            ("ring_kernels", section_ring_kernels),
            ("autosp_kernels", section_autosp_kernels),
            ("memory_plan", section_memory_plan),
            ("optimizer", section_optimizer),
            ("packed_attention", section_packed_attention),
            ("peak_memory", section_peak_memory),
            ("fsdp", section_fsdp),
            ("simulated_2d", section_simulated_2d),
            ("plan_vs_measured_baselines", section_plan_vs_measured_baselines),
            ("simulated_sp", section_simulated_sp)]


def environment() -> dict:
    """torch, Python, the device and its SDPA kernels, apex."""
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "cuda_available": torch.cuda.is_available(), "cpu": platform.processor(),
           "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
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
                        "predicted_gib", "peak_error", "step_error", "fb_error",
                        "measured_host_gib", "predicted_host_gib", "peak_live_gib",
                        "measured_mib", "predicted_mib", "host_mib",
                        "tokens_per_s", "tflops_per_device", "mfu", "step_s", "max_fit",
                        "first_oom", "first_step_s", "cell_s") if any(k in r for r in rows)]
    lines = ["| section | check | status | " + " | ".join(keys) + " | note |",
             "|" + "---|" * (len(keys) + 4)]
    for r in rows:
        lines.append(f"| {r['section']} | {r['check']} | {r['status']} | "
                     + " | ".join(fmt(r.get(k)) for k in keys) + f" | {r.get('note', '')} |")
    return "\n".join(lines)


class Results:
    """The rows so far and where the run is, written to ``gpu_check.json`` and ``gpu_check.md``
    under ``out`` after every change (atomically: a kill leaves the last complete files)."""

    def __init__(self, out: str, env: dict, smoke: bool, order: list, t0: float):
        self.out, self.env, self.smoke, self.order, self.t0 = out, env, smoke, order, t0
        self.rows: list = []
        self.running = None  # the section under way
        os.makedirs(out, exist_ok=True)

    def start(self, section: str) -> None:
        self.running = section
        self.write(complete=False)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write(complete=False)

    def data(self, complete: bool) -> dict:
        return {"environment": self.env, "smoke": self.smoke, "complete": complete,
                "seconds": time.time() - self.t0, "sections": self.order,
                "running": None if complete else self.running, "rows": self.rows}

    def write(self, complete: bool, stopped: str = "") -> dict:
        data = self.data(complete)
        if stopped:
            data["stopped"] = stopped
        atomic_write_text(os.path.join(self.out, "gpu_check.json"), json.dumps(data, indent=1))
        env = self.env
        head = (f"GPU check, {env['time']}: torch {env['torch']}, "
                f"{env.get('device', 'CPU only')}"
                f"{' (smoke run: no GPU figures)' if self.smoke else ''}, {data['seconds']:.0f} s")
        if not complete:
            done = {r["section"] for r in self.rows}
            left = [s for s in self.order if s not in done and s != self.running]
            head += (f"\n\n**Incomplete**: {stopped or 'the run is under way or was stopped'}; "
                     f"last section started: {self.running or 'none'}; not reached: "
                     f"{', '.join(left) or 'none'}.")
        atomic_write_text(os.path.join(self.out, "gpu_check.md"),
                      f"{head}\n\n{table(self.rows)}\n")
        return data


def not_run(args) -> dict:
    """Without a CUDA device (and without ``--smoke``) the check does not run: it says so, and
    writes that it has not run (never a table of skipped rows that reads like a result; an
    output that holds a GPU run is left as it is)."""
    reason = "not run: no CUDA device (torch.cuda.is_available() is False); --smoke runs the " \
             "harness on CPU, without GPU figures"
    path = os.path.join(args.output, "gpu_check.json")
    data = {"environment": environment(), "smoke": False, "complete": False, "not_run": reason,
            "rows": []}
    print(f"gpu_check.py: {reason}", flush=True)
    try:
        with open(path) as f:
            if json.load(f).get("environment", {}).get("cuda_available"):
                return data  # a GPU run's results are not replaced by "not run"
    except (OSError, ValueError):
        pass
    os.makedirs(args.output, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1))
    atomic_write_text(os.path.join(args.output, "gpu_check.md"),
                  f"GPU check: {reason}. There are no GPU figures.\n")
    return data


class _Stopped(Exception):
    pass


def _stop(signum, frame):
    raise _Stopped(f"stopped by signal {signal.Signals(signum).name}")


def run(args) -> dict:
    """Every section of ``args.sections`` in :data:`SECTIONS` order within ``args.time_limit``
    (``args.smoke``: on CPU, tiny shapes); writes ``gpu_check.json`` and ``gpu_check.md`` under
    ``args.output`` after every row, prints the table at the end and returns what the JSON
    holds. A section that raises is a FAIL row and the run goes on; SIGTERM (a ``timeout``)
    ends it with the files written."""
    if not args.smoke and not torch.cuda.is_available():
        return not_run(args)
    t0 = time.time()
    deadline = t0 + args.time_limit
    env = environment()
    wanted = set(args.sections.split(","))
    order = [n for n, _ in SECTIONS if n in wanted]
    res = Results(args.output, env, args.smoke, order, t0)
    res.add(Row("env", "torch / device", "ok", f"torch {env['torch']}, "
                + (env.get("device") or "no CUDA device")
                + f", apex {'yes' if env['apex'] else 'no'}"))
    previous = signal.signal(signal.SIGTERM, _stop)
    stopped = ""
    try:
        for name, fn in SECTIONS:
            if name not in wanted:
                continue
            res.start(name)
            print(f"[gpu_check {time.time() - t0:5.0f} s] {name}", flush=True)
            try:
                for row in fn(args, deadline):
                    res.add(row)
            except _Stopped:
                raise
            except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
                res.add(Row(name, "section", "FAIL", f"{type(e).__name__}: {e}"[:300]))
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()  # the workers that follow get the whole device
    except (_Stopped, KeyboardInterrupt) as e:
        stopped = str(e) or "interrupted"
    finally:
        kill_workers()
        signal.signal(signal.SIGTERM, previous)
    result = res.write(complete=not stopped, stopped=stopped)
    print(table(res.rows), flush=True)
    return result
