"""Chunk loops under the planner's probing (autosp_lm/compiler/chunking.py): the loss head's
and the tiled regions' loops run their first two chunks and their last and allocate the same
peak as the whole loop, so the planner measures their bodies in three iterations at any
length. (Probing one chunk of each size was 4 KB low: the first iteration has no leftovers of
an earlier one.)"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp_lm.compiler import chunking, ops
from autosp_lm.planner.capture import _LiveBytes, _storage_key


def _peak(fn, make):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = make()
    tracker = _LiveBytes({_storage_key(t) for t in args if isinstance(t, torch.Tensor)})
    with mode, tracker.mode:
        fn(*args)
    return tracker.peak


def test_ranges_probe_the_first_two_chunks_and_the_last():
    assert list(chunking.ranges(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    with chunking.probing():
        assert list(chunking.ranges(10, 4)) == [(0, 4), (4, 8), (8, 10)]
        assert list(chunking.ranges(50, 4)) == [(0, 4), (4, 8), (48, 50)]
    assert len(list(chunking.ranges(50, 4))) == 13  # outside the block: every chunk again


def test_loss_head_peak_is_the_same_under_probing():
    """The fused loss head's forward and backward bodies (compiler/ops.py) at 40 chunks of
    1024 tokens and a short last one: the peak of the probed loop is the whole loop's, to the
    byte, in fp32 and bf16."""
    n, hidden, vocab, chunk = 40 * 1024 + 300, 64, 512, 1024
    for dtype in (torch.float32, torch.bfloat16):
        def make():
            h = torch.empty(n, hidden, dtype=dtype)
            w = torch.empty(vocab, hidden, dtype=dtype)
            t = torch.zeros(n, dtype=torch.long)
            return h, w, t, torch.empty(n, dtype=torch.float32), torch.empty((), dtype=torch.float32)

        def fwd(h, w, t, lse, g):
            ops.forward_chunks(h, w, None, t, -100, chunk)

        def bwd(h, w, t, lse, g):
            ops.backward_chunks(g, h, w, None, t, lse, -100, chunk)

        for fn in (fwd, bwd):
            whole = _peak(fn, make)
            with chunking.probing():
                probed = _peak(fn, make)
            assert probed == whole > 0, (fn.__name__, dtype, probed, whole)
