#!/usr/bin/env python
"""The long-context goals, cell by cell, from the JSON files ``tools/benchmark_sp.py`` writes.

For every model shape, dtype and sequence length found in the inputs, and every AutoSP point
measured there (the default policy, ``--curve``'s memory targets, ``autosp-offload``), one row
with the three goals of the SAC memory passes (``docs/sac.md``):

* **saved**: bytes saved for the backward per local token, on the device, against today's SAC
  (``autosp-keepcomm``: never communicate twice, no sequence tiling) at the same cell;
* **peak**: the step's live-tensor peak (the larger rank) against hand-written Ulysses, taken from
  real ranks where the cell ran on real ranks, else from one simulated rank (marked ``sim``);
* **step**: the step time against AutoSP without SAC, per interleaved round (``--interleave``):
  the median of the per-round ratios, their mean and its standard error, and the number of rounds.
  Only interleaved runs count: separate jobs drift by more than the bound on a shared host. The
  goal is judged on the mean: *met* when mean + s.e. <= 1.05, *at the bound* when the mean is
  within one s.e. of 1.05, *missed* otherwise.

Nothing is computed here that the inputs do not hold: a figure a cell lacks is ``-``. Inputs are
read in order and a later input replaces an earlier one's figure of the same kind for the same
cell and point (so list older runs first). ::

    python tools/long_context_goals.py docs/bench/step_time_cpu_interleaved_gpt_tiny_bf16.json \\
        'docs/bench/memory_cpu.json#sim_wide_fp32_8192_ulysses+autosp-nosac+autosp-keepcomm+autosp' \\
        'docs/bench/step_time_cpu_interleaved_llama_tiny_8k_bf16.json@bf16=1' --output goals.md

An input is ``PATH[#KEY][@NAME=VALUE,...]``: ``#KEY`` picks one entry of a JSON file that holds
several runs; ``@`` supplies what an older file did not record (``bf16=1``, ``model=``,
``overrides=``) or a shape's name (``label=wide``). A file that does not say its dtype and gets
no ``@bf16=`` is refused rather than guessed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Any, Optional

GOALS = {"saved": 0.5, "peak": 0.5, "step": 1.05}
REFERENCE = {"saved": "autosp-keepcomm", "peak": "ulysses", "step": "autosp-nosac"}
#: points whose goals are reported (the others are references only)
POINT_PREFIXES = ("autosp", "target", "offload")  # --curve names "target F", "offload, target F"
NOT_POINTS = {"autosp-nosac", "autosp-keepcomm"}


def parse_spec(spec: str) -> tuple[str, Optional[str], dict]:
    notes: dict = {}
    if "@" in spec:
        spec, tail = spec.rsplit("@", 1)
        for item in filter(None, tail.split(",")):
            if "=" not in item:
                raise SystemExit(f"input annotation {item!r} is not NAME=VALUE (in {spec!r})")
            k, v = item.split("=", 1)
            if k not in ("bf16", "model", "overrides", "label"):
                raise SystemExit(f"unknown input annotation {k!r}: use bf16=, model=, overrides= "
                                 "or label=")
            notes[k] = v
    path, _, key = spec.partition("#")
    return path, key or None, notes


def blocks_of(obj: Any, where: str):
    """Every run in a JSON value: (results list, environment/flags dict, where)."""
    if isinstance(obj, dict) and isinstance(obj.get("results"), list):
        env = dict(obj.get("environment") or {})
        if "flags" not in env and isinstance(obj.get("flags"), dict):
            env["flags"] = obj["flags"]
        yield obj["results"], env, where
    elif isinstance(obj, dict) and isinstance(obj.get("curves"), dict):
        env = obj.get("environment") or {}
        for length, rows in obj["curves"].items():
            yield rows, env, f"{where} curve {length}"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, dict):
                yield from blocks_of(v, f"{where}#{k}")


def truthy(v: Any) -> bool:
    return str(v).lower() in ("1", "true", "yes", "bf16")


class Cells:
    def __init__(self):
        #: (label, dtype, seq) -> point -> kind -> value
        self.cells: dict = {}
        self.sources: dict = {}

    def add(self, results: list, env: dict, notes: dict, where: str) -> None:
        flags = env.get("flags") or {}
        model = notes.get("model") or flags.get("model") or env.get("model")
        if model is None:
            raise SystemExit(f"{where}: no model recorded; add @model=NAME")
        if "bf16" in notes:
            bf16 = truthy(notes["bf16"])
        elif "bf16" in flags:
            bf16 = bool(flags["bf16"])
        else:
            raise SystemExit(f"{where}: the file does not record its dtype; add @bf16=0 or @bf16=1")
        over = notes.get("overrides", flags.get("model_overrides") or "")
        label = notes.get("label") or (f"{model} ({over})" if over else model)
        dtype = "bf16" if bf16 else "fp32"
        for r in results:
            if r.get("status") not in (None, "ok"):
                continue
            name = r.get("point") or r["strategy"]
            cell = self.cells.setdefault((label, dtype, int(r["seq_length"])), {})
            point = cell.setdefault(name, {})
            src = self.sources.setdefault((label, dtype, int(r["seq_length"])), set())
            src.add(where)
            dev = r.get("saved_device_bytes_per_token", r.get("saved_bytes_per_token"))
            if dev is not None:
                point["saved"] = float(dev)
            peaks = [p for p in (r.get("peak_live_bytes_ranks") or [r.get("peak_live_bytes")])
                     if p is not None]
            if peaks:
                point["peak_sim" if r.get("simulated") else "peak_real"] = float(max(peaks))
            ratios = r.get("paired_ratios")
            if r.get("timing") == "interleaved" and ratios and \
                    r.get("paired_ref") == REFERENCE["step"]:
                point["step"] = [float(x) for x in ratios]
                point["step_where"] = where

    def load(self, spec: str) -> None:
        path, key, notes = parse_spec(spec)
        with open(path) as f:
            obj = json.load(f)
        where = path
        if key is not None:
            if not isinstance(obj, dict) or key not in obj:
                raise SystemExit(f"{path}: no entry {key!r} (entries: "
                                 f"{', '.join(obj) if isinstance(obj, dict) else 'none'})")
            obj, where = obj[key], f"{path}#{key}"
        found = False
        for results, env, w in blocks_of(obj, where):
            self.add(results, env, notes, w)
            found = True
        if not found:
            raise SystemExit(f"{where}: no benchmark results in it (expected 'results' or "
                             "'curves' as tools/benchmark_sp.py writes them)")


def peak_pair(point: dict, ref: dict) -> tuple[Optional[float], str]:
    """AutoSP's peak over Ulysses', both from real ranks if both ran there, else both simulated."""
    for kind, tag in (("peak_real", ""), ("peak_sim", " sim")):
        if kind in point and kind in ref:
            return point[kind] / ref[kind], tag
    return None, ""


def step_summary(ratios: list) -> tuple[float, float, float, int]:
    n = len(ratios)
    mean = statistics.fmean(ratios)
    se = statistics.stdev(ratios) / math.sqrt(n) if n > 1 else float("nan")
    return statistics.median(ratios), mean, se, n


def verdict(value: Optional[float], goal: float, se: float = 0.0) -> str:
    if value is None:
        return "-"
    if value <= goal - se:
        return "met"
    if value - se <= goal:
        return "at the bound"
    return "missed"


def rows(cells: Cells) -> list:
    out = []
    for (label, dtype, seq), points in sorted(cells.cells.items()):
        ref_saved = points.get(REFERENCE["saved"], {}).get("saved")
        ref_peak = points.get(REFERENCE["peak"], {})
        keep = points.get(REFERENCE["saved"], {})
        keep_step = step_summary(keep["step"]) if "step" in keep else None
        for name, p in points.items():
            if name in NOT_POINTS or not name.startswith(POINT_PREFIXES):
                continue
            saved = p.get("saved")
            saved_ratio = saved / ref_saved if (saved is not None and ref_saved) else None
            peak_ratio, peak_tag = peak_pair(p, ref_peak)
            step = step_summary(p["step"]) if "step" in p else None
            out.append(dict(shape=label, dtype=dtype, seq=seq, point=name, saved=saved,
                            ref_saved=ref_saved, saved_ratio=saved_ratio, peak_ratio=peak_ratio,
                            peak_tag=peak_tag, step=step, keepcomm_step=keep_step,
                            saved_verdict=verdict(saved_ratio, GOALS["saved"]),
                            peak_verdict=verdict(peak_ratio, GOALS["peak"]),
                            step_verdict=verdict(step[1], GOALS["step"], step[2]) if step else "-"))
    return out


def fmt(x: Optional[float], spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(table: list, inputs: list) -> str:
    command = "python tools/long_context_goals.py " + " ".join(
        f"'{s}'" if any(c in s for c in "#@+ ") else s for s in inputs)
    lines = ["# Long-context goals of the SAC memory passes, cell by cell", "",
             f"Produced by `{command}` from the benchmark runs it names (`tools/benchmark_sp.py`; "
             "the goals: `docs/sac.md`). Saved bytes per local token on the device against today's "
             "SAC (`autosp-keepcomm`), the step's live-tensor peak (the larger rank) against "
             "Ulysses, the step time against AutoSP without SAC per interleaved round.", "",
             "| shape | dtype | tokens | point | saved B/token (vs today's SAC) | goal <= 0.5 | "
             "peak live vs Ulysses | goal <= 0.5 | step vs no SAC per round: median, mean +- s.e. "
             "(rounds) | goal <= 1.05 | today's SAC's step vs no SAC: mean +- s.e. |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        saved = "-" if r["saved"] is None else (
            f"{r['saved']:.0f} ({fmt(r['saved_ratio'])}x of {r['ref_saved']:.0f})"
            if r["saved_ratio"] is not None else f"{r['saved']:.0f}")
        peak = "-" if r["peak_ratio"] is None else f"{r['peak_ratio']:.3f}x{r['peak_tag']}"
        step = "-"
        if r["step"]:
            med, mean, se, n = r["step"]
            step = f"{med:.3f}, {mean:.3f} +- {se:.3f} ({n})"
        keep = "-"
        if r["keepcomm_step"]:
            keep = f"{r['keepcomm_step'][1]:.3f} +- {r['keepcomm_step'][2]:.3f}"
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['seq']} | {r['point']} | {saved} | "
                     f"{r['saved_verdict']} | {peak} | {r['peak_verdict']} | {step} | "
                     f"{r['step_verdict']} | {keep} |")
    lines += ["", "The step goal is judged on the mean of the per-round ratios: *met* when the mean "
              "plus one standard error is at most 1.05, *at the bound* when the mean is within one "
              "standard error of it, *missed* otherwise. Saved bytes and peaks are exact and judged "
              "as they are. `sim`: the peaks of one "
              "simulated rank (`--simulate-world-size 2`). Inputs, in order:", ""]
    lines += [f"* `{s}`" for s in inputs]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="PATH[#KEY][@NAME=VALUE,...] (see the module doc)")
    p.add_argument("--output", help="write the Markdown table here (default: print it)")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    cells = Cells()
    for spec in args.inputs:
        cells.load(spec)
    table = rows(cells)
    text = markdown(table, args.inputs)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
