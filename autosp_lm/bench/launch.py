"""One benchmark cell as a fresh job (``torchrun`` for several processes, the cell's own process
for one): a crash, an out-of-memory or a timeout of the cell becomes a failed-cell record and the
run goes on; a cell whose sequence its ranks cannot split is that record without a launch."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

#: the repository root: the jobs' working directory and ``PYTHONPATH``
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch_cell(cell: dict, timeout: float) -> dict:
    """Run one cell as a fresh job; failures become a failed-cell record."""
    nproc = cell_nproc(cell)
    base = {"strategy": cell["strategy"], "seq_length": cell["seq_length"], "sp": cell_sp(cell)}
    refused = split_refusal(cell)
    if refused:  # what every rank of the job would raise, without starting it
        return dict(base, status="failed", error=refused, wall_s=0.0)
    fd, result_file = tempfile.mkstemp(prefix="bench_cell_", suffix=".json")
    os.close(fd)
    os.unlink(result_file)
    cell = dict(cell, result_file=result_file)
    cmd = job_command(cell, nproc)
    env = dict(os.environ, OMP_NUM_THREADS=str(cell.get("threads") or 1), PYTHONPATH=ROOT)
    caches = None
    if not cell.get("warm_compile_cache"):  # compile time of a first run: nothing cached
        caches = tempfile.mkdtemp(prefix="bench_cell_caches_")
        env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(caches, "triton"))
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
        proc = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        stop_job(proc)
        return dict(base, status="failed", error=f"timed out after {timeout:.0f} s")
    finally:
        if caches:
            shutil.rmtree(caches, ignore_errors=True)
    if proc.returncode != 0 or not os.path.exists(result_file):
        tail = (proc.stderr or "")[-3000:] + (proc.stdout or "")[-1000:]
        oom = "out of memory" in tail.lower() or "OutOfMemoryError" in tail or proc.returncode in (-9, 137)
        return dict(base, status="oom" if oom else "failed", returncode=proc.returncode,
                    error=last_error(tail), wall_s=time.time() - t0)
    with open(result_file) as f:
        result = json.load(f)
    os.unlink(result_file)
    result["wall_s"] = time.time() - t0
    return result


def cell_nproc(cell: dict) -> int:
    """Processes of a cell's job: one for the single-device strategies and simulated worlds."""
    return 1 if (cell["strategy"].startswith("none") or cell.get("simulate_world_size")) \
        else cell["nproc"]


def cell_sp(cell: dict) -> int:
    """The sequence-parallel size of a cell's job (its ranks, real or simulated; 1 for the
    single-device strategies), as :class:`~autosp_lm.bench.job.Job` sets it."""
    if cell["strategy"].startswith("none"):
        return 1
    return cell.get("simulate_world_size") or cell["nproc"]


def split_refusal(cell: dict) -> str | None:
    """The error every rank of the cell's job would raise because its sequence cannot be split
    over the job's ranks (the rule all strategies share:
    :func:`autosp_lm.parallel.slicing.check_sequence_length`; a ring's zigzag layout asks more,
    which the job itself checks), or None."""
    sp = cell_sp(cell)
    if sp == 1:
        return None
    from autosp_lm.parallel.slicing import check_sequence_length
    try:
        check_sequence_length(cell["seq_length"], sp, strategy=cell["strategy"])
    except ValueError as e:
        return f"ValueError: {e}"
    return None


def job_command(cell: dict, nproc: int) -> list:
    """The cell's job: ``python -m autosp_lm.bench.cell CELL`` in one process, under torchrun
    for several (a torchrun agent costs a process and its import of torch)."""
    entry = ["-m", "autosp_lm.bench.cell", json.dumps(cell)]
    if nproc == 1:
        return [sys.executable] + entry
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}"] + entry




def descendants(pid: int) -> list:
    """Process ids below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def stop_job(proc: subprocess.Popen) -> None:
    """End a timed-out cell: SIGTERM to its process (torchrun stops its workers, which run in
    sessions of their own, so killing torchrun alone, as ``subprocess.run``'s timeout does, left
    them running); SIGKILL to whatever is left after 30 s."""
    below = descendants(proc.pid)
    proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid] + below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()


def last_error(text: str) -> str:
    """The last exception line (``SomeError: message``) of a failed job's output."""
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    pattern = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception|Unsupported)): ")
    for line in reversed(lines):
        if pattern.match(line):
            return line[:500]
    for line in reversed(lines):
        if "rror" in line:
            return line[:500]
    return (lines[-1] if lines else "no output")[:500]

