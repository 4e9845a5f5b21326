#!/usr/bin/env python
"""Kill a rank, let torchrun restart the job, compare every loss with an uninterrupted run.

Runs one uninterrupted torchrun job, then ``--runs`` jobs under ``torchrun --max-restarts 1``
in which rank ``--kill-rank`` SIGKILLs itself in the middle of iteration ``--kill-iteration``
(tests/helpers/pretrain_faults.py, first attempt only); every job uses ``--load`` equal to
``--save`` (the auto-resume idiom) in a fresh directory. Prints, per job, its exit code, whether
it restarted and where it resumed, and the largest difference between any loss it logged (both
attempts, replayed iterations included) and the uninterrupted run's loss of that iteration.

    python tests/helpers/measure_restarts.py --runs 5                # llama-tiny, --autosp, SP 2
    python tests/helpers/measure_restarts.py --runs 2 -- --model gpt-tiny --ulysses --mock-data

Everything after ``--`` replaces the default training flags (``--model llama-tiny --autosp``).
The exit status is 0 only if every job exited 0, restarted once, and every loss is identical.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(ROOT, "tests", "helpers", "pretrain_faults.py")
DEFAULT_FLAGS = ["--model", "llama-tiny", "--autosp"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(workdir: str, flags: list, *, train_iters: int, save_interval: int, nproc: int = 2,
        fault: str = "", kill_iteration: int = 0, kill_rank: int = 1, max_restarts: int = 1,
        standalone: bool = False, timeout: float = 3600) -> dict:
    """One torchrun job in ``workdir``: its exit code, log and metrics rows."""
    os.makedirs(workdir, exist_ok=True)
    ck, metrics = os.path.join(workdir, "ck"), os.path.join(workdir, "metrics.jsonl")
    rdzv = ["--standalone"] if standalone else ["--master-port", str(free_port())]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.1", *rdzv, FAULTS,
           *flags, "--train-iters", str(train_iters), "--log-interval", "1",
           "--save", ck, "--load", ck, "--save-interval", str(save_interval),
           "--metrics-file", metrics]
    env = dict(os.environ, AUTOSP_FAULT=fault, AUTOSP_FAULT_ITERATION=str(kill_iteration),
               AUTOSP_FAULT_RANK=str(kill_rank), PYTHONUNBUFFERED="1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + paths)  # the ranks import this tree
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    log = out.stdout + out.stderr
    with open(os.path.join(workdir, "log.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + log)
    rows = []
    if os.path.exists(metrics):
        rows = [json.loads(line) for line in open(metrics).read().splitlines()]
        rows = [r for r in rows if "lm_loss" in r]  # training rows (evaluation rows beside them)
    resumed = re.findall(r"resumed from (\S+) at iteration (\d+)", log)
    return {"returncode": out.returncode, "log": log, "rows": rows, "seconds": time.monotonic() - t0,
            "killed": "[fault] rank" in log, "resumed": resumed, "cmd": cmd}


def loss_difference(rows: list, reference: dict) -> float:
    """The largest |loss - reference loss| over ``rows``; inf if an iteration is missing."""
    if sorted({r["iteration"] for r in rows}) != sorted(reference):
        return float("inf")
    return max(abs(r["lm_loss"] - reference[r["iteration"]]) for r in rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = DEFAULT_FLAGS
    if "--" in argv:
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--kill-iteration", type=int, default=9)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--standalone", action="store_true", help="torchrun's c10d rendezvous "
                   "(--standalone) instead of the static one on a free port")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="restarts_")
    common = dict(train_iters=args.train_iters, save_interval=args.save_interval, nproc=args.nproc,
                  standalone=args.standalone)
    print(f"flags: {' '.join(flags)}; {args.nproc} ranks; --train-iters {args.train_iters} "
          f"--save-interval {args.save_interval}; rank {args.kill_rank} killed in iteration "
          f"{args.kill_iteration}; logs in {work}", flush=True)
    ref = job(os.path.join(work, "uninterrupted"), flags, **common)
    if ref["returncode"] != 0:
        print(ref["log"][-3000:])
        print("the uninterrupted run failed")
        return 1
    reference = {r["iteration"]: r["lm_loss"] for r in ref["rows"]}
    print(f"uninterrupted: exit 0, {len(reference)} iterations, {ref['seconds']:.0f} s", flush=True)
    ok, worst = True, 0.0
    for n in range(1, args.runs + 1):
        res = job(os.path.join(work, f"run{n}"), flags, fault="kill", kill_iteration=args.kill_iteration,
                  kill_rank=args.kill_rank, **common)
        diff = loss_difference(res["rows"], reference)
        worst = max(worst, diff)
        good = res["returncode"] == 0 and res["killed"] and len(res["resumed"]) == 1 and diff == 0.0
        ok &= good
        where = res["resumed"][0][0] if res["resumed"] else "-"
        print(f"run {n}: exit {res['returncode']}, killed: {res['killed']}, resumed from {where}, "
              f"losses logged {len(res['rows'])}, largest loss difference {diff!r}, "
              f"{res['seconds']:.0f} s{'' if good else '  <-- FAILED'}", flush=True)
    print(f"{'all' if ok else 'NOT all'} {args.runs} jobs exited 0 after one restart; largest loss "
          f"difference to the uninterrupted run: {worst!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
