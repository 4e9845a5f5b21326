"""The benchmark's plots (PNG, with matplotlib: the ``bench`` extra); none without it."""
from __future__ import annotations

import os
import sys

from .names import STRATEGIES


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt, fig, path: str) -> str:
    """Write ``fig`` to ``path`` (110 dpi) and close it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(out: str, results: list[dict], max_ctx: dict) -> list[str]:
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: skipping plots (pip install -e \".[bench]\")", file=sys.stderr)
        return []
    files = []
    ok = [r for r in results if r.get("status") == "ok"]
    order = list(STRATEGIES)  # the table's order; 2-D names (autosp-u2 ...) after it, by name
    names = sorted({r["strategy"] for r in ok},
                   key=lambda n: (order.index(n) if n in order else len(order), n))
    for key, label, fname in (("saved_bytes_per_token", "activation bytes saved per local token", "saved_bytes_per_token.png"),
                              ("tokens_per_s", "tokens/s", "tokens_per_s.png")):
        if not any(r.get(key) is not None for r in ok):  # e.g. no step timed (--steps 0)
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in names:
            pts = sorted((r["seq_length"], r[key]) for r in ok if r["strategy"] == n and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.set_title(label + " vs sequence length")
        ax.grid(alpha=0.3)
        ax.legend()
        files.append(save(plt, fig, os.path.join(out, fname)))
    found = {n: m["max_seq_length"] for n, m in max_ctx.items() if m.get("max_seq_length")}
    if max_ctx and not found:
        print("no max-context plot: " + "; ".join(f"{n}: {m.get('reason') or 'not found'}"
                                                  for n, m in max_ctx.items()), file=sys.stderr)
    if found:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(found), list(found.values()))
        method = "CPU fit" if any(m["method"] == "fit" for m in max_ctx.values()) else "measured"
        ax.set_ylabel("max trainable sequence length")
        ax.set_title(f"max context per rank within the budget, {method}")
        files.append(save(plt, fig, os.path.join(out, "max_context.png")))
    return files




def plot_curve(out: str, curves: dict) -> list[str]:
    """``curve.png``: peak live memory against step time for each point of ``--curve``."""
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for seq, rows in curves.items():
        ok = [r for r in rows if r.get("status") == "ok"]
        tgt = sorted((r for r in ok if "target_fraction" in r), key=lambda r: -r["target_fraction"])
        line, = ax.plot([r["time_vs_nosac"] for r in tgt], [r["peak_live_bytes"] / 2**20 for r in tgt],
                        marker="o", label=f"{seq} tokens: memory target (fraction of no-SAC saved bytes)")
        for r in ok:
            if "target_fraction" in r:
                ax.annotate(f"{r['target_fraction']:g}", (r["time_vs_nosac"], r["peak_live_bytes"] / 2**20),
                            fontsize=7, xytext=(3, -9), textcoords="offset points")
            else:
                ax.scatter([r["time_vs_nosac"]], [r["peak_live_bytes"] / 2**20], marker="s",
                           color=line.get_color())
                ax.annotate(r["point"], (r["time_vs_nosac"], r["peak_live_bytes"] / 2**20),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("step time / AutoSP without SAC")
    ax.set_ylabel("peak live tensor memory per rank (MiB)")
    ax.set_title("memory target knob: peak memory vs step time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [save(plt, fig, os.path.join(out, "curve.png"))]

