"""Loops over sequence chunks whose iterations are alike, and how they run for the planner.

The tiled regions (:mod:`.tiling`) and the fused loss head (:mod:`.ops`) walk the tokens in
chunks: their outputs and accumulators are allocated before the loop, and each iteration makes
its chunk's transients, writes into them and frees them (a local variable lives on until the
next iteration assigns it again). From the second chunk on, every chunk of one size therefore
allocates exactly what every other one does, and the loop's peak is reached in the second
chunk or in the (shorter) last.

The memory planner runs these ops' bodies on fake tensors to measure their peak
(:func:`autosp_lm.planner.capture.custom_op_inner_peak`), at every length it tries; at millions
of tokens that is thousands of alike iterations, minutes per prediction. Under
:func:`probing` a loop runs its first two chunks and its last, which allocate the same peak.
Training never probes.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_PROBE = contextvars.ContextVar("autosp_lm_chunk_probe", default=False)


@contextlib.contextmanager
def probing():
    """Within the block, chunk loops run one chunk of each size (their peak, not their work)."""
    token = _PROBE.set(True)
    try:
        yield
    finally:
        _PROBE.reset(token)


def ranges(n: int, step: int) -> Iterator[tuple]:
    """``(start, end)`` of the chunks of ``step`` tokens (the last one shorter) of ``n``; under
    :func:`probing`, the first two and the last: an iteration's local variables live on into
    the next one until they are assigned again, so the first chunk allocates less than every
    later one, the second as much as any full chunk after it, and the last follows a full one
    as in the whole loop."""
    step = max(1, step)
    starts = range(0, n, step)
    if _PROBE.get() and len(starts) > 3:
        starts = [starts[0], starts[1], starts[-1]]
    for s in starts:
        yield s, min(n, s + step)


__all__ = ["probing", "ranges"]
