"""Every attempt of a job meets on its own part of the job's store
(autosp_lm/parallel/rendezvous.py), and every group we make has the collective timeout.

torchrun restarts ranks against the agent's store, which still holds the keys the killed attempt
wrote; torch's ``init_process_group`` keys it the same way every attempt, so a restarted rank
could read a dead rank's address (``Gloo connectFullMesh failed ... Connection refused``).
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from autosp_lm.parallel import rendezvous
from autosp_lm.parallel.rendezvous import RendezvousError, attempt_number
from tests.helpers.launch import Job


def _attempt(store, ranks, world, delays=None, timeout=5.0):
    """Run the handshake of one attempt on threads (one per rank started)."""
    out = {}

    def run(r):
        time.sleep((delays or {}).get(r, 0))
        try:
            out[r] = attempt_number(store, r, world, datetime.timedelta(seconds=timeout),
                                    poll_seconds=0.05)
        except RendezvousError as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_attempt_numbers_agree_and_are_never_reused():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    first = _attempt(store, [0, 1, 2], 3)
    assert len(set(first.values())) == 1
    # the next attempt's ranks 1 and 2 start before its rank 0: they first read the number of
    # the last attempt's (dead) rank 0, are never acknowledged, and take the new one
    second = _attempt(store, [0, 1, 2], 3, delays={0: 0.4, 2: 0.1})
    assert len(set(second.values())) == 1 and set(second.values()) != set(first.values())
    # an attempt whose rank 2 never started: rank 0 says so, by rank
    store.set_timeout(datetime.timedelta(seconds=1))
    partial = _attempt(store, [0, 1], 3, timeout=1.0)
    assert isinstance(partial[0], RendezvousError) and "rank 2 did not join" in str(partial[0])
    store.set_timeout(datetime.timedelta(seconds=5))
    third = _attempt(store, [0, 1, 2], 3, delays={1: 0.2})
    numbers = set(third.values())
    assert len(numbers) == 1 and not numbers & (set(first.values()) | set(second.values()))


# ---------------------------------------------------------------- a restart against one store
def _rank(rank, port, attempt, timeout_s, queue):
    """One rank of one attempt, with torchrun's worker environment around a store the test
    hosts (the agent's)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(attempt))
    try:
        import torch
        from autosp_lm.parallel.state import init_parallel
        from autosp_lm.parallel.gloo import gloo_worker_threads
        if attempt == 1 and rank == 1:
            time.sleep(1.5)  # rank 0 meets the store first: the killed attempt's keys are there
        ps = init_parallel(1, timeout_minutes=timeout_s / 60)
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x)
        dist.all_reduce(x, group=ps.dp_group)
        groups = [dist.group.WORLD, ps.sp_group, ps.dp_group,
                  rendezvous.new_group(description="checkpoint group", backend="gloo")]
        timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                    for g in groups]
        if attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # killed mid-job, as in the issue
        queue.put((rank, "ok", (x.tolist(), timeouts, gloo_worker_threads(ps.dp_group))))
    except BaseException as e:  # noqa: BLE001
        queue.put((rank, "error", f"{type(e).__name__}: {e}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)  # no clean shutdown, as when torchrun stops the ranks


def _run_attempt(port, attempt, timeout_s):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, attempt, timeout_s, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    results = {}
    while not queue.empty():
        rank, status, payload = queue.get()
        results[rank] = (status, payload)
    return results


def test_a_restarted_attempt_never_meets_the_killed_attempts_keys():
    """Deterministic: rank 1 of the restart comes 1.5 s late, so rank 0 reads the store while
    the killed attempt's keys are still there. torch's own path (``init_process_group`` on the
    agent store) connects to the dead rank and fails with ``Connection refused`` here."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))  # torchrun's agent store
    first = _run_attempt(store.port, 0, 20.0)
    assert first.get(0, ("?",))[0] == "ok", first
    second = _run_attempt(store.port, 1, 20.0)
    assert second.get(0, ("?",))[0] == "ok" and second.get(1, ("?",))[0] == "ok", second
    for rank in (0, 1):
        values, timeouts, threads = second[rank][1]
        assert values == [6.0, 6.0, 6.0]  # (1 + 2) summed again over the dp group
        assert timeouts == [20.0] * 4  # world, sp, dp and a gloo side group: the flag's timeout
        assert threads == 1  # the one-worker gloo groups (gloo.py) are still what we make


def test_the_checkpoint_group_is_made_with_the_default_groups_timeout(monkeypatch):
    from autosp_lm.training import checkpoint_dist
    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(rendezvous, "new_group", lambda *a, **k: made.append(k) or "group")
    assert checkpoint_dist.checkpoint_group("nccl") == "group"
    assert made == [{"description": "checkpoint group", "backend": "gloo"}]


def _mesh_timeouts(rank, world):
    import torch
    from autosp_lm.parallel.mesh import forget_groups, ulysses_ring_groups
    from autosp_lm.parallel.state import init_parallel
    ps = init_parallel(4)  # the launch made the default group (rendezvous.init_default_group)
    mesh = ulysses_ring_groups(ps.sp_group, 2)
    forget_groups()
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for g in (mesh.ulysses_group, mesh.ring_group)], rendezvous.group_timeout().total_seconds()


MESH = Job("tests.parallel.test_rendezvous:_mesh_timeouts")
LAUNCH = {4: [MESH]}


def test_ulysses_and_ring_groups_have_the_default_groups_timeout(launch4):
    for timeouts, default in launch4(MESH):
        assert timeouts == [default, default]
        assert default != 1800.0  # not torch's own default for a new gloo group


def test_failure_kinds():
    from autosp_lm.parallel import health
    gloo_timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                                "6000ms for recv operation to complete")
    gloo_peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                             "[127.0.0.1]:5020")
    assert health.failure_kind(gloo_timeout) == "timeout"
    assert health.failure_kind(gloo_peer) == "peer"
    assert health.failure_kind(ValueError("shape mismatch")) is None
    assert health.failure_kind(BrokenPipeError(32, "Broken pipe")) is None  # stdout closed
    assert health.describe_failure(ValueError("shape mismatch")) is None


@pytest.mark.parametrize("minutes,interval", [(30, 5.0), (0.1, 0.6), (0.01, 0.2)])
def test_heartbeat_interval(minutes, interval):
    from autosp_lm.parallel import health
    assert health.heartbeat_interval(datetime.timedelta(minutes=minutes)) == pytest.approx(interval)
