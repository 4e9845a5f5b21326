import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _isolate_wandb(tmp_path, monkeypatch):
    """Never talk to W&B servers from tests; keep caches inside the test's tmp dir."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("AUTOSP_LM_CACHE", str(tmp_path / "autosp_cache"))


@pytest.fixture(scope="session")
def launch2(request):
    """The session's shared 2-rank launch (tests/helpers/launch.py)."""
    from tests.helpers import launch
    return launch.start(request.session, 2)


@pytest.fixture(scope="session")
def launch4(request):
    """The session's shared 4-rank launch (tests/helpers/launch.py)."""
    from tests.helpers import launch
    return launch.start(request.session, 4)


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
