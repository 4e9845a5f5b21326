"""What the GPU check's sections share: a row of the table, relative errors, the worker
processes (each cell a fresh Python process: an OOM or a crash is that cell's row) and their
shares of the time left."""
from __future__ import annotations

import json
import os
import signal
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


def _worker_cmd(cell: dict, path: str) -> list:
    return [sys.executable, "-m", "autosp_lm.bench.gpu.worker", json.dumps(cell), path]


def _worker_env(cell: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    if cell.get("compile_threads"):  # workers compiling at once share the cores
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(cell["compile_threads"])
    return env


#: the worker processes started and not finished (killed by :func:`kill_workers`)
LIVE: set = set()


def kill_workers() -> None:
    """Kill every worker still running (the run is stopping: none may outlive it)."""
    for pend in list(LIVE):
        pend.kill()


class Pending:
    """A worker process started for ``cell`` (:mod:`.worker`), not waited for yet."""

    def __init__(self, cell: dict):
        fd, self.path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        self.cell, self.t0 = cell, time.time()
        self.log = tempfile.TemporaryFile(mode="w+")
        # a process group of its own: killing the worker kills its compile workers too
        self.proc = subprocess.Popen(_worker_cmd(cell, self.path), stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=_worker_env(cell), start_new_session=True)
        LIVE.add(self)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def result(self, timeout: float) -> dict:
        """Its result, or ``{"error": ...}`` (the output's tail, or the timeout: then it is
        killed); ``cell_s``: the worker's wall time."""
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            return {"error": f"timed out after {time.time() - self.t0:.0f} s",
                    "cell_s": time.time() - self.t0}
        try:
            if self.proc.returncode != 0:
                self.log.seek(0)
                return {"error": _tail(self.log.read(), self.proc.returncode),
                        "cell_s": time.time() - self.t0}
            with open(self.path) as f:
                return dict(json.load(f), cell_s=time.time() - self.t0)
        finally:
            self.cleanup()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.cleanup()

    def cleanup(self) -> None:
        LIVE.discard(self)
        self.log.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


def _tail(output: str, code: int) -> str:
    """The last lines of a failed worker's output (its error), one line."""
    lines = [x for x in output.strip().splitlines() if x.strip()]
    last = " | ".join(lines[-3:]) if lines else "no output"
    return f"exit {code}: {last}"[-600:]


def run_worker(cell: dict, timeout: float) -> dict:
    """Run ``cell`` in a fresh worker process (:mod:`.worker`); its result, or ``{"error": ...}``
    (the output's tail, or the timeout)."""
    return Pending(cell).result(timeout)


def skip_note(est: float, left: float) -> str:
    return (f"time limit: needs about {est:.0f} s (estimate for one H100), {max(0.0, left):.0f} s "
            f"left (--time-limit)")


def unfinished_row(section: str, check: str, res: dict):
    """The row of a cell that did not produce figures (skipped, failed), else None."""
    if "skipped" in res:
        return Row(section, check, "skipped", res["skipped"])
    if "error" in res:
        return Row(section, check, "FAIL", str(res["error"])[-300:],
                   **({"cell_s": res["cell_s"]} if "cell_s" in res else {}))
    return None


def run_cells(section: str, cells: list, stop: float, slack: float = 15.0, parallel: int = 1,
              memory_gib: float = float("inf")):
    """Run the worker of each ``(check, cell)`` in order, yielding ``(check, result)`` as each
    finishes (in order): the worker's result, or ``{"error": ...}`` for one that failed or was
    killed (the run goes on), or ``{"skipped": note}`` for one not started because its estimated
    cost (``cell["est_s"]``, seconds on one H100; default 30) does not fit the time left before
    ``stop`` (later, cheaper cells still run: nothing is dropped), or ``cell["skip"]``'s note
    for a cell not to run at all (e.g. a recipe not in this tree). Up to ``parallel`` cells run
    at once (workers that measure memory, not time) while their ``cell["mem_gib"]`` add up to
    at most ``memory_gib`` of the device (one runs alone whatever it needs); each gets
    ``cell["budget_s"]``, an even share of the time left, ``slack`` seconds less (searches stop
    there)."""
    queue, running = list(enumerate(cells)), []
    n = len(cells)
    out: dict = {}
    nxt = 0

    def room(cell) -> bool:
        used = sum(p.cell.get("mem_gib", 0.0) for _, p in running)
        return not running or used + cell.get("mem_gib", 0.0) <= memory_gib

    while nxt < n:
        while queue and (len(running) < parallel and room(queue[0][1][1])
                         or "skip" in queue[0][1][1]):
            i, (check, cell) = queue.pop(0)
            left = stop - time.time()
            est = cell.get("est_s", 30.0)
            if "skip" in cell:  # not to run (e.g. not in this tree): its row, in its place
                out[i] = {"skipped": cell["skip"]}
                continue
            if left < est:
                out[i] = {"skipped": skip_note(est, left)}
                continue
            to_run = sum("skip" not in c for _, c in cells[i:])
            cell["budget_s"] = max(est, left / max(1, to_run / parallel)) - slack
            running.append((i, Pending(cell)))
        if nxt in out:
            yield cells[nxt][0], out.pop(nxt)
            nxt += 1
            continue
        for j, (i, pend) in enumerate(running):
            if i == nxt:
                running.pop(j)
                out[i] = pend.result(timeout=max(30.0, stop - time.time() + slack))
                break
        else:  # every cell before nxt is done: nxt was never started (cannot happen)
            raise RuntimeError(f"run_cells: cell {nxt} neither ran nor was skipped")


def run_together(section: str, cells: list, stop: float, sync_dir: str):
    """Timed cells sharing one device: every worker builds and compiles at once (the slow part,
    CPU bound), then they measure one at a time, alone on the device: each worker writes
    ``ready_<i>`` in ``sync_dir`` when warmed up and waits for ``go_<i>`` before its timed steps.
    Yields ``(check, result)`` in order; a cell whose estimate (``est_s``: its warm-up, on one
    H100) does not fit the time left is skipped, one that fails or is not ready by ``stop`` is an
    error, the others go on."""
    n = len(cells)
    started, results = {}, {}
    for i, (check, cell) in enumerate(cells):
        left = stop - time.time()
        est = cell.get("est_s", 60.0)
        if "skip" in cell:
            results[i] = {"skipped": cell["skip"]}
            continue
        if left < est:
            results[i] = {"skipped": skip_note(est, left)}
            continue
        cell.update(sync_dir=sync_dir, index=i, budget_s=left - 10, parent=os.getpid())
        started[i] = Pending(cell)

    def ready(i):
        return os.path.exists(os.path.join(sync_dir, f"ready_{i}"))

    for i in range(n):
        if i in results:
            yield cells[i][0], results.pop(i)
            continue
        pend = started.pop(i)
        while not ready(i) and not pend.done() and time.time() < stop:
            time.sleep(0.2)
        if not ready(i) and not pend.done():
            pend.kill()
            yield cells[i][0], {"error": f"not warmed up by the time limit "
                                         f"({time.time() - pend.t0:.0f} s)"}
            continue
        # the others still compiling share the CPU, not the device: wait until every started
        # worker is warm (or gone) so that this one's timed steps are alone
        while any(not ready(j) and not p.done() for j, p in started.items()) \
                and time.time() < stop:
            time.sleep(0.2)
        open(os.path.join(sync_dir, f"go_{i}"), "w").close()
        yield cells[i][0], pend.result(timeout=max(30.0, stop - time.time() + 30))
    for p in started.values():
        p.kill()


def wait_for_turn(cell: dict) -> None:
    """In a :func:`run_together` worker: say it is warm, wait for its turn (none outside)."""
    d = cell.get("sync_dir")
    if not d:
        return
    open(os.path.join(d, f"ready_{cell['index']}"), "w").close()
    go = os.path.join(d, f"go_{cell['index']}")
    give_up = time.time() + cell.get("budget_s", 600)
    while not os.path.exists(go):
        if os.getppid() != cell.get("parent", os.getppid()) or time.time() > give_up:
            raise SystemExit("gpu_check worker: the run that started it is gone or over time")
        time.sleep(0.05)


def length_row(section: str, check: str, r: dict, keep=None) -> Row:
    """The row of one measured length ``r`` of a simulated worker (its figures, or ``keep``)."""
    status = "ok" if r["status"] == "ok" else r["status"]
    return Row(section, f"{check} S={r['seq_length']}", status,
               **{k: v for k, v in r.items() if k not in ("seq_length", "status")
                  and (keep is None or k in keep)})


def run_one_cell(section: str, check: str, cell: dict, args, deadline: float):
    """A section of one cell: ``(row, results)``. ``row``: the section's one row when it does not
    run (no CUDA device outside ``--smoke``) or its cell did not finish, else None; ``results``:
    the cell's ``{name: result}`` entries that are dicts."""
    if not args.smoke and not torch.cuda.is_available():
        return Row(section, "section", "skipped", "no CUDA device"), {}
    for _, res in run_cells(section, [(check, cell)], deadline):
        row = unfinished_row(section, check, res)
        if row is not None:
            return row, {}
        return None, {k: v for k, v in res.items() if isinstance(v, dict)}
    return Row(section, check, "FAIL", "the cell produced no result"), {}
