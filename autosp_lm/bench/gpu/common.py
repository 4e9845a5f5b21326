"""What the GPU check's sections share: a row of the table, relative errors, the worker
processes (each cell a fresh Python process: an OOM or a crash is that cell's row) and their
shares of the time left."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from ..launch import ROOT


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


class Row(dict):
    """One line of the table: section, check, status (ok / FAIL / skipped), figures, note."""

    def __init__(self, section, check, status, note="", **figures):
        super().__init__(section=section, check=check, status=status, note=note, **figures)


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``."""
    return str(dtype).split(".")[-1]


def first_line(err: Exception) -> str:
    """The first line of an error (a kernel not built or not supported on this GPU), for a
    skipped row's note."""
    return str(err).strip().splitlines()[0][:120]


def init_fake_world(world: int) -> None:
    """Make this process rank 0 of a ``world``-rank job with a fake process group (collectives
    return correctly shaped, meaningless tensors): one rank's memory and compute."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def run_worker(cell: dict, timeout: float) -> dict:
    """Run ``cell`` in a fresh worker process (:mod:`.worker`); its result, or ``{"error": ...}``
    (the output's tail, or the timeout)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "autosp_lm.bench.gpu.worker", json.dumps(cell), path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    try:
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout)[-2000:]}
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def run_cells(section: str, cells: list, stop: float, rows: list, slack: float = 15.0):
    """Run the worker of each ``(check, cell)`` in turn, each given an even share of the time
    left before ``stop`` (``cell["budget_s"]``, the worker's own limit, ``slack`` seconds less);
    a cell with under 30 s left is recorded in ``rows`` as skipped, a failed one as FAIL. Yields
    ``(check, result)`` of the cells that ran."""
    for i, (check, cell) in enumerate(cells):
        left = stop - time.time()
        if left < 30:
            rows.append(Row(section, check, "skipped", "time limit"))
            continue
        cell["budget_s"] = left / (len(cells) - i) - slack
        res = run_worker(cell, timeout=max(30.0, left - 5))
        if "error" in res:
            rows.append(Row(section, check, "FAIL", str(res["error"])[-300:]))
            continue
        yield check, res


def length_row(section: str, check: str, r: dict, keep=None) -> Row:
    """The row of one measured length ``r`` of a simulated worker (its figures, or ``keep``)."""
    status = "ok" if r["status"] == "ok" else r["status"]
    return Row(section, f"{check} S={r['seq_length']}", status,
               **{k: v for k, v in r.items() if k not in ("seq_length", "status")
                  and (keep is None or k in keep)})

