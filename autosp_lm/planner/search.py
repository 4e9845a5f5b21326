"""The runs of ``tools/plan_memory.py``: the plan of each strategy at one length, the search of the
longest length per strategy and SP size (with the longest context within a step-time margin), and
``--validate``'s table; the lines they print, their progress lines, the JSON they write and the
max-context plot.

The tool parses and checks its flags, then calls :func:`plan_each`, :func:`search_each` or
:func:`validate_run`; the traces and predictions are :mod:`.plan`'s (looked up at call time, so
that a test can stand in for them), the measured rows :mod:`.check`'s.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

from . import check, plan
from .plan import GiB


class Progress:
    """One line per event on ``stream`` (stderr: stdout keeps the results), flushed, each with the
    seconds since the start: the planner's traces (``trace n of m``, the depth extrapolation's
    cut models included), each length tried, the strategy and SP size being searched. ``quiet``:
    nothing."""

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet, self.stream, self.t0 = quiet, stream, time.time()

    def __call__(self, line: str) -> None:
        if not self.quiet:
            print(f"[plan_memory {time.time() - self.t0:6.0f} s] {line}",
                  file=self.stream or sys.stderr, flush=True)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def print_plan(r: dict) -> None:
    """A plan's peak and its breakdown, as lines on stdout."""
    print(f"{r['strategy']} at {r['seq_length']} tokens, SP {r['sp']}, world {r['world_size']}: "
          f"peak {gib(r['peak_bytes'])} ({r['peak_phase']} phase; at {r['peak_node']})")
    for k, v in r["breakdown"].items():
        print(f"  {k:<52} {gib(v):>12}")
    print(f"  (saved for backward on the device: {gib(r['saved_activations_bytes'])}; fits in "
          f"{r['budget_gib']:.1f} GiB: {'yes' if r['fits'] else 'NO'})")
    if r.get("host_bytes"):
        cap = r["host_budget_bytes"]
        print(f"  host memory (offloaded activations): {gib(r['host_bytes'])}"
              + (f" of {gib(cap)} per GPU: {'fits' if r['fits_host'] else 'does NOT fit'}"
                 if cap else ""))


def plot(path: str, results: list, title: str) -> bool:
    """The max-context-vs-SP-size plot; False (nothing drawn) where matplotlib is not installed
    (it is an extra: ``pip install -e ".[bench]"``)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in dict.fromkeys(r["strategy"] for r in results):
        pts = sorted((r["sp_requested"], r["max_seq_length"]) for r in results
                     if r["strategy"] == name and r["max_seq_length"] > 0)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence-parallel size")
    ax.set_ylabel("max trainable tokens (predicted)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_json(path: str, data: dict) -> None:
    """``data`` as JSON at ``path``, atomically (a run stopped while writing keeps the last
    file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def first_length(seq_length: int, sp: int) -> int:
    """The length the search first traces at: ``seq_length`` rounded down to the granularity
    (256 tokens per rank), at least one granule."""
    g = 256 * sp
    return max(g, seq_length // g * g)


def plan_each(names: list, cfg, sp: int, seq: int, layout, budget: int, *, bf16: bool,
              offload: bool, depth: dict) -> list:
    """Each strategy of ``names`` traced and predicted at ``seq`` tokens on ``sp`` ranks, printed
    (:func:`print_plan`) with whether it fits ``budget`` bytes (and the host's share). ``depth``:
    :func:`~.plan.trace_step`'s depth, check_depth, sac_device and progress."""
    progress, plans = depth["progress"], []
    for i, name in enumerate(names):
        progress(f"strategy {i + 1} of {len(names)}: {name}, SP {sp}, {seq} tokens")
        traced = plan.trace_step(name, cfg, sp, seq, bf16=bf16, offload=offload, layout=layout,
                                 **depth)
        t1 = time.time()
        r = plan.predict(traced, seq, layout)
        progress(f"{name} SP {sp}: predicted at {seq} tokens ({time.time() - t1:.0f} s)")
        r.update(budget_gib=budget / GiB, fits=r["peak_bytes"] <= budget and r["fits_host"])
        print_plan(r)
        plans.append(r)
    return plans


def search_each(names: list, cfg, sizes: list, layout, budget: int, *, seq_length: int,
                bf16: bool, offload: bool, confirm: bool, within_percent: float, depth: dict,
                command: Callable[[str, int, int], dict],
                on_result: Callable[[list], None]) -> tuple:
    """The longest length that fits ``budget`` per strategy and SP size of ``sizes`` (the first
    trace at :func:`first_length` of ``seq_length``), each printed with its ``pretrain.py``
    command (``command(name, length, sp)``: ``{"command", "command_note"}``), ``on_result(results)``
    after each (a run cut short keeps what it found); then per SP size the longest context whose
    plan is within ``within_percent`` of the fastest step time. Returns ``(results, within)``."""
    progress = depth["progress"]
    results, within = [], []
    for j, sp in enumerate(sizes):
        traces: dict = {}
        for i, name in enumerate(names):
            where = (f"strategy {i + 1} of {len(names)}: {name}, SP {sp} "
                     f"(SP size {j + 1} of {len(sizes)})")
            if name == "none" and sp != sizes[0]:
                prev = next(r for r in results if r["strategy"] == "none")
                results.append(dict(prev, sp_requested=sp))
                progress(f"{where}: none does not shard the sequence; SP {sizes[0]}'s answer")
                continue
            first = first_length(seq_length, sp)
            progress(f"{where}: searching the longest length (first trace at {first} tokens)")
            t1 = time.time()
            traced = plan.trace_step(name, cfg, sp, first, bf16=bf16, offload=offload,
                                     layout=layout, **depth)
            t2 = time.time()
            r = plan.find_max_seq_length(name, cfg, sp, layout, budget, bf16=bf16,
                                         offload=offload, confirm=confirm, traced=traced,
                                         keep=traces, **depth)
            r.update(sp_requested=sp, first_trace_s=t2 - t1, search_s=time.time() - t2)
            results.append(r)
            host = r.get("at_max", {}).get("host_bytes", 0)
            step = r.get("at_max", {}).get("predicted_step_s")
            confirmed = ("confirmed by a trace at that length" if r["confirmed"]
                         else "NOT confirmed: " + str(r["traces"]))
            print(f"{name:>13} SP {sp:>3}: max {r['max_seq_length']:>9} tokens "
                  + (f"(host {host / GiB:.1f} GiB per GPU) " if host else "")
                  + (f"(step {step:.3g} s predicted) " if step else "")
                  + f"({confirmed}; trace {t2 - t1:.0f} s, search {r['search_s']:.0f} s)",
                  flush=True)
            r.update(command(name, r["max_seq_length"], sp))
            print(f"{'':>13} run: {r['command']}"
                  + (f"\n{'':>13} ({r['command_note']})" if r["command_note"] else ""),
                  flush=True)
            on_result(results)
        progress(f"SP {sp}: step times of every plan at each longest length "
                 f"(--within-percent {within_percent:g})")
        w = plan.longest_within([r for r in results if r["sp_requested"] == sp], traces, layout,
                                within_percent)
        within.append(dict(w, sp=sp))
        a = w["answer"]
        print(f"longest context within {within_percent:g}% of the fastest plan's step time, "
              f"SP {sp}: " + (f"{a['seq_length']} tokens ({a['strategy']}, {a['ratio']:.2f}x "
                              f"{a['fastest']})" if a else "none"), flush=True)
    return results, within


def validate_run(shapes: dict, lengths: dict, names: list, *, bf16: bool, fsdp2: bool,
                 trace_each_length: bool, output, command: str) -> dict:
    """``--validate``: predictions against the measured CPU peaks of real runs (one rank of SP 2)
    of ``shapes`` at ``lengths``, each row printed; with ``output`` the JSON and the Markdown
    table next to it, rewritten after every row (a run cut short keeps its rows, marked
    incomplete). ``command``: the command line the table records."""
    import torch
    env = {"torch": torch.__version__, "cpu_count": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command}
    md = os.path.splitext(output)[0] + ".md" if output else None

    def write(rows, done):
        out = {"rows": rows, "environment": dict(env, complete=done)}
        if output:
            write_json(output, out)
            with open(md, "w") as f:
                f.write(check.markdown(rows, env) + ("" if done else
                        "\n**Incomplete**: the run stopped before every row was measured.\n"))
        return out

    rows = check.validate(shapes, names, lengths, sp=2, bf16=bf16, fsdp2=fsdp2,
                          trace_each_length=trace_each_length,
                          log=lambda line: print(line, flush=True),
                          on_row=lambda rs: write(rs, False))
    out = write(rows, True)
    if output:
        print(f"wrote {output}, {md}")
    return out


__all__ = ["Progress", "gib", "print_plan", "plot", "write_json", "first_length", "plan_each",
           "search_each", "validate_run"]
