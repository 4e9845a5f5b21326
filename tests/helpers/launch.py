"""One process launch per world size for the whole test session, run in the background.

Spawning gloo ranks, importing torch and warming Dynamo/AOTAutograd costs a launch tens of
seconds on a 2-core machine before its first case computes anything. Test modules therefore
declare what they need from a 2- or 4-rank launch at module level::

    LAUNCH = {2: [C.Case("gpt-tiny"), Job("tests.parallel.test_ring:ring_worker", (...))]}

and read their results through the ``launch2`` / ``launch4`` fixtures (tests/conftest.py):
``launch2(item)`` -> that item's results by rank. Once the session's tests are collected,
:func:`begin` starts the launches in background threads (the 2- and the 4-rank one at once:
a rank waiting in a collective leaves its core to the other launch), each running the
items of every module that has a selected test using its fixture (in collection order, each
item once even if several modules declare it), so running one file still runs only that file's
items; tests/conftest.py moves the tests that read a launch to the end of the session, so the
single-process tests run on the cores the ranks leave free instead of waiting for them.

Every item runs on its own inside the launch: an exception is recorded for that item (and
reported, with the rank's traceback, by the tests that read it), the next item still runs.
``tests.helpers.autosp_cases.Case`` items keep their own error convention (a result with an
``"error"`` entry, which ``check_parity`` reports).
"""
from __future__ import annotations

import importlib
import inspect
import multiprocessing
import os
import threading
import time
import traceback
from dataclasses import dataclass

import pytest


@dataclass(frozen=True, eq=False)
class Job:
    """``fn(rank, world, *args)`` inside a shared launch; ``fn`` is ``"module:function"``
    (importable in a spawned process); ``args`` must be picklable. Two jobs are the same job
    when their function and the ``repr`` of their arguments are equal."""

    fn: str
    args: tuple = ()

    @property
    def id(self) -> str:
        return f"{self.fn}{self.args!r}"

    def __eq__(self, other):
        return isinstance(other, Job) and self.id == other.id

    def __hash__(self):
        return hash(self.id)


class JobError:
    """The traceback of a job that raised on one rank (picklable)."""

    def __init__(self, text: str):
        self.text = text


def _resolve(name: str):
    module, func = name.split(":")
    return getattr(importlib.import_module(module), func)


def job_worker(rank, world, items):
    """Run every item in order on this rank; -> {item: result} and, under :data:`SECONDS`,
    {item id: seconds it took on this rank}. Cases through ``autosp_cases.run_case`` (errors as
    ``{"error": traceback}``), jobs through their function (errors as :class:`JobError`)."""
    import torch

    from tests.helpers import autosp_cases as C
    os.nice(NICE.get(world, 15))  # the ranks take the cores the session's own tests leave idle
    results, seconds, cpu = {}, {}, {}
    for item in items:
        t0, c0 = time.perf_counter(), _cpu()
        torch.manual_seed(0)
        if isinstance(item, C.Case):
            results[item] = C.worker(rank, world, [item])[item]
        else:
            torch._dynamo.reset()  # each job compiles afresh: no recompile limit shared
            try:
                results[item] = _resolve(item.fn)(rank, world, *item.args)
            except (Exception, SystemExit):  # noqa: BLE001 - reported by the tests that read it
                results[item] = JobError(traceback.format_exc())
        seconds[item.id] = time.perf_counter() - t0
        cpu[item.id] = _cpu() - c0
    results[SECONDS] = seconds
    results[CPU_SECONDS] = cpu
    return results


def _cpu() -> float:
    """CPU seconds of this process and its finished children, which unlike wall time do not
    grow with the machine's load. Inductor's C++ compiler runs are children only with
    ``TORCHINDUCTOR_COMPILE_THREADS=1``; by default they run in its worker processes, which
    finish with the launch, so an item's figure then leaves them out."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


#: The key of a rank's results under which :func:`job_worker` puts each item's time (shown by
#: ``pytest --durations``, tests/conftest.py).
SECONDS = "__seconds__"
#: ... and each item's CPU seconds on this rank (:func:`_cpu`)
CPU_SECONDS = "__cpu_seconds__"


class SharedLaunch:
    """The results of one launch; call with an item to get its results by rank."""

    def __init__(self, world: int, items: list, per_rank: list):
        self.world, self.items, self.per_rank = world, items, per_rank
        #: item id -> the slowest rank's seconds; item id -> CPU seconds summed over the ranks
        self.seconds, self.cpu_seconds = {}, {}
        for res in per_rank:
            for name, t in res.get(SECONDS, {}).items():
                self.seconds[name] = max(t, self.seconds.get(name, 0.0))
            for name, t in res.get(CPU_SECONDS, {}).items():
                self.cpu_seconds[name] = t + self.cpu_seconds.get(name, 0.0)

    def __call__(self, item):
        if item not in self.items:
            raise KeyError(f"{getattr(item, 'id', item)} is not declared in the module's "
                           f"LAUNCH[{self.world}]: add it there")
        out = [r[item] for r in self.per_rank]
        for rank, res in enumerate(out):
            if isinstance(res, JobError):
                pytest.fail(f"{item.id} failed on rank {rank} of the shared {self.world}-rank "
                            f"launch:\n{res.text}", pytrace=False)
        return out


def uses(item, world: int) -> bool:
    """Whether a collected test may read the ``world``-rank launch: through a fixture (its own
    or one it depends on), or (its module declaring ``LAUNCH[world]``) through
    ``request.getfixturevalue`` in the test itself. Only the test function's own ``request``
    argument counts: ``tmp_path`` and ``monkeypatch`` put ``request`` in every test's fixture
    closure, which made half the tests of such modules wait for the launch at the end of the
    session, on one core, after the ranks had finished."""
    names = getattr(item, "fixturenames", ())
    if f"launch{world}" in names:
        return True
    if not getattr(getattr(item, "module", None), "LAUNCH", {}).get(world):
        return False
    try:
        return "request" in inspect.signature(item.obj).parameters
    except (TypeError, ValueError):
        return False


def collect(items, world: int) -> list:
    """The items of ``LAUNCH[world]`` of every module with a test (of ``items``) that reads the
    ``world``-rank launch, in order, once."""
    out, seen_modules = [], set()
    for test in items:
        module = getattr(test, "module", None)
        if module is None or module in seen_modules or not uses(test, world):
            continue
        seen_modules.add(module)
        for item in getattr(module, "LAUNCH", {}).get(world, ()):
            if item not in out:
                out.append(item)
    return out


WORLDS = (2, 4)
#: the order in which the launches' readers run: the 4-rank launch has about a quarter of the
#: 2-rank one's work (CPU seconds) and ends first
READ_ORDER = (4, 2)
#: the launches' ranks run at these nicenesses (by world size): behind the tests in the
#: session's process (and the processes those start), which would otherwise wait for cores the
#: ranks hold; the 2-rank launch ahead of the 4-rank one, whose work is a quarter of its own and
#: whose readers run first (READ_ORDER): the 2-rank launch is the session's longest chain
NICE = {2: 10, 4: 15}
STARTED: dict = {}  # world -> the session's SharedLaunch (for the durations report)
_PENDING: dict = {}  # world -> (threading.Event set when that launch ended, [exception or None])
_THREAD: list = []


def begin(items, timeout: float = 3600) -> None:
    """Start the launches the selected ``items`` read, all at once, each in a background thread
    (the timeout is a hang guard for each whole launch, not a budget). Concurrent launches fill
    the cores a launch leaves idle while its ranks wait for each other in collectives."""
    from tests.helpers.dist import run_distributed
    plan = [(world, collect(items, world)) for world in WORLDS]
    plan = [(world, todo) for world, todo in plan if todo]
    for world, _ in plan:
        _PENDING[world] = (threading.Event(), [None])

    def run(world, todo):
        done, error = _PENDING[world]
        try:
            STARTED[world] = SharedLaunch(world, todo, run_distributed(
                job_worker, world, todo, timeout=timeout))
        except BaseException as e:  # noqa: BLE001 - raised by the tests that read it
            error[0] = e
        finally:
            done.set()
    for world, todo in plan:
        thread = threading.Thread(target=run, args=(world, todo), name=f"shared-launch-{world}",
                                  daemon=True)
        _THREAD.append(thread)
        thread.start()


def result(world: int) -> SharedLaunch:
    """The ``world``-rank launch begun by :func:`begin`, once it has ended (its failure, if the
    launch as a whole failed)."""
    if world not in _PENDING:
        raise RuntimeError(f"no {world}-rank launch was begun: does the test module declare "
                           f"LAUNCH[{world}] and the test use the launch{world} fixture?")
    done, error = _PENDING[world]
    done.wait()
    if error[0] is not None:
        raise RuntimeError(f"the shared {world}-rank launch failed") from error[0]
    return STARTED[world]


class Pending:
    """The ``launch{world}`` fixture's value: the ``world``-rank launch, waited for when first
    read (a call, or an attribute such as ``per_rank``), not when the test starts. A test
    marked ``overlap_launch`` runs first among the launch's readers and does its own work (its
    own processes) before it reads, so that work overlaps the launch's last items instead of
    following them."""

    def __init__(self, world: int):
        self.world = world

    def __call__(self, item):
        return result(self.world)(item)

    def __getattr__(self, name):
        return getattr(result(self.world), name)


def reader_rank(item) -> int:
    """Where a collected test runs (tests/conftest.py sorts by it, stable): 0 the tests that
    read no launch (first, on the cores the ranks leave idle), then the readers of each launch
    in :data:`READ_ORDER` (a reader of several with the last of them), of each launch those
    marked ``overlap_launch`` first."""
    worlds = [w for w in READ_ORDER if uses(item, w)]
    if not worlds:
        return 0
    marked = item.get_closest_marker("overlap_launch") is not None
    return 1 + 2 * READ_ORDER.index(worlds[-1]) + (0 if marked else 1)


def end() -> None:
    """At the end of the session: stop the ranks of a launch still running (a session stopped
    early, ``-x``), so that the interpreter does not wait for them."""
    if any(thread.is_alive() for thread in _THREAD):
        for child in multiprocessing.active_children():
            child.terminate()


def durations_report(limit: int) -> list:
    """Lines naming the slowest items of this session's launches (``limit`` <= 0: all)."""
    lines = []
    for world, launch in sorted(STARTED.items()):
        rows = sorted(launch.seconds.items(), key=lambda kv: -kv[1])
        total, cpu = sum(launch.seconds.values()), sum(launch.cpu_seconds.values())
        lines.append(f"shared {world}-rank launch: {len(rows)} items, {total:.1f} s in items "
                     f"(wall, slowest rank), {cpu:.1f} CPU s (all ranks)")
        lines += [f"{t:8.2f}s {launch.cpu_seconds.get(name, 0.0):8.2f} CPU s  {name}"
                  for name, t in (rows[:limit] if limit > 0 else rows)]
    return lines
