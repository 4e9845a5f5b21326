"""Every attempt of a job gets a rendezvous of its own: in-job restarts connect every time.

torchrun restarts the ranks of a job (``--max-restarts``) against the same key-value store: the
agent's TCPStore outlives its workers (torch/distributed/elastic/rendezvous/
static_tcp_rendezvous.py keeps ``self._store`` across ``next_rendezvous``; dynamic_rendezvous.py
makes its shared server once), and its address is what the workers get as ``MASTER_ADDR`` /
``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``). ``init_process_group`` keys that store
the same way in every attempt (``PrefixStore("default_pg")``, then the group's name, which is a
counter that restarts at 0, then the device), and torch's ``_create_c10d_store`` adds no
per-attempt prefix on the agent store (its comment says the agent makes a new store for every
retry; the agents of torch 2.13, the version read, do not). So the keys a killed attempt wrote
are still there when the next attempt starts:

* gloo (``createAndConnectAllPairs``): each rank sets its key (its listening address) and reads
  every peer's key; a peer's stale key is read at once, its address belongs to a dead process:
  ``Gloo connectFullMesh failed ... Connection refused`` (or, if the port is in use again, a hang);
* NCCL (``broadcastUniqueNCCLID``): rank 0 sets the unique id under a counter key, the others
  ``get`` it; a stale id from the last attempt sends them to a dead root.

Whether a rank reads the stale key or the fresh one is a race: the restart fails at random.
``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts its own restarts, and
an agent that restarts its workers because another node failed does not count it (torch's
elastic agent, ``_invoke_run``: "membership changes do not count as retries"; pytorch#108158,
pytorch#135712), so the ranks of one attempt can disagree on it.

What every rank of one attempt can agree on is a number only that attempt can know: rank 0 takes
a new one from the store's counter (``store.add`` never hands out the same number twice) and
posts it; every other rank takes its own new number the same way, answers rank 0's under a key
naming both, and goes on only when rank 0 has acknowledged that answer, under a key naming rank
0's number and its own, which no earlier attempt can have written. A rank that read the number a
dead rank 0 posted is never acknowledged and reads again. All groups of the attempt then live
under ``autosp_lm/attempt/<number>/`` in the store: the default group is made on that prefixed
store, and every ``new_group`` (and a DeviceMesh's groups) uses the default group's store.
"""
from __future__ import annotations

import datetime
import time
from typing import Optional

import torch.distributed as dist

from . import health

PREFIX = "autosp_lm/rendezvous"
STORE_TIMEOUT = datetime.timedelta(minutes=10)
_WHICH = " (10 minutes, or --distributed-timeout-minutes if longer)"

_ATTEMPT: dict = {}  # "store": the attempt's prefixed store, "number", "timeout"


class RendezvousError(RuntimeError):
    """The ranks of an attempt could not meet; the message names who was missing."""


def _timed_out(error: RuntimeError) -> bool:
    """Whether a store operation failed by its timeout (torch's ``DistStoreError``; the text on
    a torch that raises a plain ``RuntimeError``)."""
    store_error = getattr(dist, "DistStoreError", None)
    return (store_error is not None and isinstance(error, store_error)) or \
        "timeout" in str(error).lower()


def attempt_number(store, rank: int, world_size: int, timeout: datetime.timedelta,
                   poll_seconds: float = 1.0) -> int:
    """The number of this attempt, the same on every rank of it and never used by an earlier
    attempt on ``store`` (module docstring). Collective over the ranks, through the store only."""
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        number = store.add(f"{PREFIX}/leader_count", 1)
        store.set(f"{PREFIX}/leader", str(number))
        for r in range(1, world_size):
            try:  # blocks until rank r answered this number (the store's timeout)
                ticket = store.get(f"{PREFIX}/answer/{number}/{r}").decode()
            except RuntimeError as e:
                if not _timed_out(e):
                    raise
                raise RendezvousError(
                    f"rank {r} did not join the rendezvous of this attempt within "
                    f"{timeout.total_seconds():.0f} s{_WHICH}; check that it started (its log) "
                    "and can reach MASTER_ADDR:MASTER_PORT") from e
            store.set(f"{PREFIX}/ack/{number}/{r}/{ticket}", "1")
        return number
    ticket = store.add(f"{PREFIX}/ticket/{rank}", 1)  # this process's own, never reused
    wait = 0.02
    while True:
        try:  # blocks until a rank 0 posted a number (the store's timeout)
            number = int(store.get(f"{PREFIX}/leader").decode())
        except RuntimeError as e:
            if not _timed_out(e):
                raise
            raise RendezvousError(
                f"rank 0 did not open the rendezvous of this attempt within "
                f"{timeout.total_seconds():.0f} s{_WHICH}; check that rank 0 started (its log) "
                "and that MASTER_ADDR:MASTER_PORT is its address") from e
        store.set(f"{PREFIX}/answer/{number}/{rank}", str(ticket))
        # poll with check(), not wait(timeout): a store wait that times out logs a warning
        if store.check([f"{PREFIX}/ack/{number}/{rank}/{ticket}"]):
            return number
        # rank 0 is slow, or the number was a dead rank 0's: look again
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank 0 did not acknowledge rank {rank} in the rendezvous of this attempt "
                f"within {timeout.total_seconds():.0f} s{_WHICH}; check that rank 0 started "
                "(its log)")
        time.sleep(wait)
        wait = min(2 * wait, poll_seconds)


def attempt_store(timeout: datetime.timedelta):
    """(store, rank, world size) for this attempt: the job's store (torch's ``env://``
    rendezvous: torchrun's agent store, or one rank 0 hosts at ``MASTER_ADDR:MASTER_PORT``)
    under a prefix that is this attempt's alone."""
    # the ranks of a job start minutes apart on a busy cluster: the store waits at least
    # STORE_TIMEOUT for them, whatever the collective timeout
    store_timeout = max(timeout, STORE_TIMEOUT)
    store, rank, world = next(dist.rendezvous("env://", timeout=store_timeout))
    store.set_timeout(store_timeout)
    number = attempt_number(store, rank, world, store_timeout)
    prefix = f"autosp_lm/attempt/{number}"
    prefixed = dist.PrefixStore(prefix, store)
    _ATTEMPT.update(store=prefixed, number=number, timeout=timeout, prefix=prefix)
    return prefixed, rank, world


def init_default_group(backend: str, timeout: datetime.timedelta, device_id=None) -> None:
    """``init_process_group`` from the launcher's environment on this attempt's own store
    (collectives time out after ``timeout``); records what the failure line needs
    (:mod:`.health`) and starts this rank's heartbeat."""
    health.enable_flight_recorder()
    store, rank, world = attempt_store(timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                            timeout=timeout, device_id=device_id)
    health.name_group(dist.group.WORLD, "world group", range(world))
    health.start_heartbeat(rank, world, timeout, _ATTEMPT["prefix"])


def current_attempt() -> Optional[int]:
    """This attempt's number (None before :func:`init_default_group`)."""
    return _ATTEMPT.get("number")


def current_store():
    """This attempt's prefixed store (None before :func:`init_default_group`)."""
    return _ATTEMPT.get("store")


def group_timeout() -> Optional[datetime.timedelta]:
    """The collective timeout the default group was made with (None before)."""
    return _ATTEMPT.get("timeout")


def new_group(ranks=None, description: str = "group", **kwargs):
    """``dist.new_group`` with the default group's timeout: torch gives a new group its own
    default (30 minutes on gloo, 10 on NCCL), not the timeout of ``init_process_group``.
    ``description`` names the group in a failure line (:mod:`.health`)."""
    timeout = group_timeout()
    if timeout is not None:
        kwargs.setdefault("timeout", timeout)
    group = dist.new_group(ranks, **kwargs)
    health.name_group(group, description,
                      ranks if ranks is not None else range(dist.get_world_size()))
    return group


def forget() -> None:
    """Forget the attempt (its default group was destroyed) and stop the heartbeat."""
    health.stop_heartbeat()
    _ATTEMPT.clear()


__all__ = ["RendezvousError", "attempt_number", "attempt_store", "init_default_group",
           "current_attempt", "current_store", "group_timeout", "new_group", "forget"]
