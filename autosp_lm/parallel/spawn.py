"""Run a function on N local processes with the gloo backend (CPU tests, tools, benchmarks)."""
from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from queue import Empty

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, threads, timeout, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    torch.set_num_threads(threads)
    try:
        from .gloo import use_single_worker_gloo
        from .rendezvous import init_default_group
        use_single_worker_gloo()  # one worker thread per gloo group (gloo.py)
        init_default_group("gloo", datetime.timedelta(seconds=timeout))  # launchers' one path
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from .state import destroy_parallel
        destroy_parallel()


def run_local(fn, world_size: int, *args, timeout: float = 600, threads: int = 1) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes and return
    their results by rank. ``fn`` must be importable (a module-level function) and its result
    picklable (numpy arrays, not tensors). Any rank's exception fails the call with that rank's
    traceback; no process is left behind."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, threads, timeout, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except Empty:
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if gone:  # a rank died without reporting (a signal, os._exit): its peers would
                    # wait in the rendezvous or a collective until the timeout; fail now
                    try:  # unless its result is still in the pipe
                        rank, status, payload = queue.get(timeout=5.0)
                    except Empty:
                        errors += [f"rank {r}: exited with code {procs[r].exitcode} without a "
                                   f"result (a negative code is the signal that killed it)"
                                   for r in gone]
                        break
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"run_local: no result from ranks "
                                       f"{sorted(set(range(world_size)) - set(results))} "
                                       f"after {timeout} s")
                else:
                    continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
