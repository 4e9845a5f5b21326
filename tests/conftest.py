import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# One intra-op thread: the tests' tensors are small, and a second OpenMP thread spins on the core
# the shared launches' ranks use meanwhile (tests/helpers/launch.py)
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolate_wandb(tmp_path, monkeypatch):
    """Never talk to W&B servers from tests; keep caches inside the test's tmp dir."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("AUTOSP_LM_CACHE", str(tmp_path / "autosp_cache"))


@pytest.fixture(scope="session")
def launch2():
    """The session's shared 2-rank launch (tests/helpers/launch.py)."""
    from tests.helpers import launch
    return launch.Pending(2)


@pytest.fixture(scope="session")
def launch4():
    """The session's shared 4-rank launch (tests/helpers/launch.py)."""
    from tests.helpers import launch
    return launch.Pending(4)


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what does not run
def pytest_collection_modifyitems(session, config, items):
    """The tests that read a shared launch run last (tests/helpers/launch.py:reader_rank;
    otherwise in collection order), so that the launches, started in the background once
    collection ends, overlap the single-process tests."""
    from tests.helpers import launch
    rank = {id(item): launch.reader_rank(item) for item in items}
    items.sort(key=lambda item: rank[id(item)])  # stable


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    from tests.helpers import launch
    launch.begin(session.items)


def pytest_sessionfinish(session):
    from tests.helpers import launch
    launch.end()
    # The session's heap (compiled graphs, symbolic-shape caches: over a million objects) made
    # the exit take ~10 s, idle: pytest's check for exceptions raised in __del__ runs five full
    # collections after this hook (gc_collect_harder), and the interpreter's shutdown walks the
    # heap again. One full collection here (the check still sees what it finalizes), then the
    # survivors are frozen out of every later collection.
    import gc
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter, config):
    """With ``--durations``: the slowest items of the shared launches, which pytest reports only
    as one test's setup time."""
    limit = config.getoption("durations", None)
    if limit is None:
        return
    from tests.helpers import launch
    lines = launch.durations_report(limit)
    if lines:
        terminalreporter.write_sep("=", "slowest shared-launch items (slowest rank)")
        for line in lines:
            terminalreporter.write_line(line)
