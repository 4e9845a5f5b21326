"""The shared launches' bookkeeping (tests/helpers/launch.py): which collected tests read a
launch, and so wait for it at the end of the session."""
from __future__ import annotations

import types

from tests.helpers import launch


def _item(fn, fixturenames, declares=True):
    module = types.SimpleNamespace(LAUNCH={2: [launch.Job("m:f")]} if declares else {})
    return types.SimpleNamespace(obj=fn, fixturenames=fixturenames, module=module)


def test_only_tests_that_read_a_launch_wait_for_it():
    def plain(tmp_path, monkeypatch):  # `request` is in its closure (tmp_path's), not its own
        pass

    def reads(request, world):  # request.getfixturevalue("launch2") in the body
        pass

    closure = ["tmp_path", "monkeypatch", "request", "tmp_path_factory"]
    assert not launch.uses(_item(plain, closure), 2)
    assert launch.uses(_item(reads, closure + ["world"]), 2)
    assert not launch.uses(_item(reads, closure + ["world"], declares=False), 2)
    assert not launch.uses(_item(reads, closure + ["world"]), 4)  # no LAUNCH[4] declared
    assert launch.uses(_item(plain, closure + ["launch2"]), 2)  # through a fixture
