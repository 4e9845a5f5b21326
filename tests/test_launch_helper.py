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


def test_readers_run_last_the_earlier_launchs_first_overlapping_ones_first_of_each():
    def plain():
        pass

    def item(fixturenames, marked=False, worlds=(2, 4)):
        it = _item(plain, fixturenames)
        it.module.LAUNCH = {w: [launch.Job("m:f")] for w in worlds}
        it.get_closest_marker = lambda name: object() if marked and name == "overlap_launch" \
            else None
        return it

    order = {"none": item(["tmp_path"]), "reads 2": item(["launch2"]),
             "reads 4": item(["launch4"]), "reads both": item(["launch2", "launch4"]),
             "overlaps 2": item(["tmp_path", "launch2"], marked=True),
             "overlaps 4": item(["launch4"], marked=True)}
    ranks = {name: launch.reader_rank(it) for name, it in order.items()}
    assert ranks["none"] < ranks["overlaps 4"] < ranks["reads 4"] < ranks["overlaps 2"] \
        < ranks["reads 2"] == ranks["reads both"], ranks


def test_the_fixture_waits_when_read_not_when_the_test_starts(monkeypatch):
    """A test marked overlap_launch gets the launch fixture at once, and a read waits until the
    launch has ended."""
    import threading
    done = threading.Event()
    monkeypatch.setitem(launch._PENDING, 7, (done, [None]))
    job = launch.Job("m:f")
    monkeypatch.setitem(launch.STARTED, 7, launch.SharedLaunch(7, [job], [{job: "r0"}, {job: "r1"}]))
    got = {}
    made = threading.Thread(target=lambda: got.update(pending=launch.Pending(7)), daemon=True)
    made.start()
    made.join(5)
    assert "pending" in got, "the fixture's value waited for a launch still running"
    read = threading.Thread(target=lambda: got.update(result=got["pending"](job)), daemon=True)
    read.start()
    read.join(0.3)
    assert read.is_alive() and "result" not in got  # the read waits for the launch ...
    done.set()
    read.join(5)
    assert got["result"] == ["r0", "r1"] and got["pending"].per_rank[1][job] == "r1"  # ... ends
