"""When a collective fails: which collective, and which rank did not arrive, in one line.

A rank that hangs (stopped, deadlocked, its host frozen) leaves its peers waiting in the next
collective they share with it until the group's timeout (``--distributed-timeout-minutes``;
every group we create has it, :func:`autosp_lm.parallel.rendezvous.new_group`). gloo then
raises ``Timed out waiting 360000ms for recv operation to complete``, which names neither the
collective nor the rank; a peer that died raises ``Connection closed by peer`` with its socket
address. :func:`describe_failure` turns such an exception into one line:

* **the collective**: the last entry of this process's flight recorder (torch's record of the
  collectives issued, enabled by :func:`enable_flight_recorder` before the first group is made:
  the op, its group and the group's sequence number); without one, the exception's own text;
* **the rank that did not arrive**: every rank runs a heartbeat thread (:func:`start_heartbeat`)
  that increments its own counter in the job's store every few seconds, on a connection of its
  own. A stopped or frozen process stops counting; a rank blocked in a collective keeps counting
  (the wait releases the GIL). On a failure the counters are read twice, a few heartbeats
  apart: the ranks whose counter did not move are named. Reading on demand keeps the store's
  load at one increment per rank per heartbeat, and needs no clock shared between hosts.
"""
from __future__ import annotations

import datetime
import os
import pickle
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

HEALTH_PREFIX = "health"
_STATE: dict = {}  # "thread", "stop", "store", "interval", "rank", "world", "timeout"
_GROUPS: dict = {}  # group name -> (description, ranks)
_PROGRESS = {"iteration": 0}

TIMEOUT_MARKERS = ("Timed out waiting", "timeout caused pair closure", "Socket Timeout",
                   "Watchdog caught collective operation timeout", "wait timeout after")
PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Read error",
                     "Broken pipe", "remote process exited")


def enable_flight_recorder(entries: int = 64) -> None:
    """Let torch record the last ``entries`` collectives of every group made from now on
    (``TORCH_FR_BUFFER_SIZE``; a value the user set is kept). Call before the first group."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)


def name_group(group, description: str, ranks) -> None:
    """Remember what a group is, for the failure line."""
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        _GROUPS[str(group.group_name)] = (description, list(ranks))


def note_iteration(iteration: int) -> None:
    """The iteration this rank is in (the trainer says so at each step)."""
    _PROGRESS["iteration"] = iteration


def heartbeat_interval(timeout: datetime.timedelta) -> float:
    """Seconds between heartbeats: a tenth of the collective timeout, between 0.2 and 5 s."""
    return min(5.0, max(0.2, timeout.total_seconds() / 10))


def _health_store(prefix: str, timeout: float):
    """A connection of its own to the job's store (``MASTER_ADDR:MASTER_PORT``), under
    ``prefix``: a main thread blocked in a store operation does not hold up the heartbeat."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(f"{prefix}/{HEALTH_PREFIX}", store)


def start_heartbeat(rank: int, world_size: int, timeout: datetime.timedelta,
                    prefix: Optional[str]) -> bool:
    """Count this rank's heartbeats under ``prefix`` (this attempt's, from
    :mod:`.rendezvous`) in the job's store from a daemon thread; a no-op for one rank or
    without a prefix. Idempotent."""
    if _STATE.get("thread") is not None or world_size <= 1 or prefix is None:
        return _STATE.get("thread") is not None
    interval = heartbeat_interval(timeout)
    try:
        store = _health_store(prefix, max(5.0, 4 * interval))
    except Exception:  # noqa: BLE001 - no heartbeat is no reason to fail the job
        store = None
    if store is None:
        return False
    stop = threading.Event()

    def beat():
        key = f"beat/{rank}"
        while not stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                pass
            stop.wait(interval)

    thread = threading.Thread(target=beat, name="autosp_lm-heartbeat", daemon=True)
    _STATE.update(thread=thread, stop=stop, store=store, interval=interval, rank=rank,
                  world=world_size, timeout=timeout)
    thread.start()
    return True


def stop_heartbeat() -> None:
    if _STATE.get("stop") is not None:
        _STATE["stop"].set()
    _STATE.clear()
    _GROUPS.clear()


def silent_ranks(ranks) -> Optional[list]:
    """The ranks among ``ranks`` whose heartbeat did not move over four heartbeats (this rank
    excluded); None when the store cannot be read."""
    store, me = _STATE.get("store"), _STATE.get("rank")
    if store is None:
        return None
    others = [r for r in ranks if r != me]

    def counts():
        return [store.add(f"beat/{r}", 0) for r in others]

    try:
        before = counts()
        time.sleep(4 * _STATE["interval"])
        after = counts()
    except Exception:  # noqa: BLE001 - the store does not answer
        return None
    return [r for r, a, b in zip(others, before, after) if a == b]


def last_collective() -> Optional[dict]:
    """The last collective this process issued, from torch's flight recorder (None without)."""
    try:
        dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
        entries = pickle.loads(dump())["entries"] if dump is not None else []
    except Exception:  # noqa: BLE001 - no recorder on this torch or backend
        return None
    pending = [e for e in entries if e.get("state") not in ("completed",)]
    return (pending or entries or [None])[-1]


def _collective_text(entry: Optional[dict], error: BaseException) -> tuple[str, Optional[list]]:
    """(what the collective was, the ranks of its group or None)."""
    if entry is None:
        return f"a collective ({' '.join(str(error).split())[:160]})", None
    op = str(entry.get("profiling_name", "collective")).split(":")[-1]
    name = str((entry.get("process_group") or ("?",))[0])
    desc, ranks = _GROUPS.get(name, (f"process group {name}", None))
    seq = entry.get("collective_seq_id") or entry.get("p2p_seq_id")
    where = f"{desc} {ranks}" if ranks is not None else desc
    return f"{op} #{seq} of the {where}", ranks


def failure_kind(error: BaseException) -> Optional[str]:
    """"timeout", "peer" (a peer's connection closed) or None (not a collective failure).
    The backends raise ``RuntimeError`` (``DistBackendError`` is one); an ``OSError`` such as a
    closed stdout's ``BrokenPipeError`` is not a collective's."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    if any(m in text for m in TIMEOUT_MARKERS):
        return "timeout"
    if any(m in text for m in PEER_LOSS_MARKERS):
        return "peer"
    return None


def describe_failure(error: BaseException) -> Optional[str]:
    """One line for a failed collective: which one, and which rank did not arrive (module
    docstring); None when ``error`` is not a collective failure. Takes a few heartbeats."""
    kind = failure_kind(error)
    if kind is None or _STATE.get("world") is None:
        return None
    what, group_ranks = _collective_text(last_collective(), error)
    everyone = list(range(_STATE["world"]))
    silent = silent_ranks(group_ranks or everyone)
    if silent == [] and group_ranks is not None:
        silent = [r for r in (silent_ranks(everyone) or []) if r not in group_ranks] or []
    timeout = _STATE["timeout"].total_seconds()
    me, it = _STATE["rank"], _PROGRESS["iteration"]
    head = (f"{what} timed out after {timeout:g} s (--distributed-timeout-minutes "
            f"{timeout / 60:g}) on rank {me}, iteration {it}" if kind == "timeout" else
            f"{what} failed on rank {me}, iteration {it}: a peer's connection closed")
    restart = ("restart the job: with --load equal to --save it resumes from the last "
               "checkpoint")
    if silent is None:
        return (f"{head}; the job's store at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} does not answer either (without torchrun it "
                f"lives in rank 0: rank 0 is stopped, hung or gone); check rank 0, then {restart}")
    if silent:
        who = ", ".join(map(str, silent))
        ranks_word = "rank" if len(silent) == 1 else "ranks"
        state = ("no heartbeat: stopped, hung, or its host is down" if kind == "timeout"
                 else "no heartbeat: it crashed or was killed, its log says why")
        return (f"{head}: {ranks_word} {who} did not arrive ({state}); check {ranks_word} {who}, "
                f"then {restart}")
    if kind == "timeout":
        return (f"{head}, with every rank alive: they are waiting in different collectives (a "
                "desync) or a step took longer than the timeout; rerun with "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL to find the collective they disagree on, or "
                "raise --distributed-timeout-minutes")
    return f"{head}; every rank still has a heartbeat; {restart}"


__all__ = ["enable_flight_recorder", "name_group", "note_iteration", "start_heartbeat",
           "stop_heartbeat", "silent_ranks", "last_collective", "failure_kind",
           "describe_failure", "heartbeat_interval"]
