"""Activation offload: ``autosp_lm::offload`` and ``autosp_lm::reload`` (the ops the offload pass
inserts, :mod:`.passes.offload_activations`).

``offload(x, slot)`` copies a saved activation to host memory right after the forward produced
it and returns the host copy (what the backward keeps); the device tensor is freed after its
last forward use. ``reload(host, slot)`` brings it back to the device for the backward.

**CUDA.** The copies run on one side stream per device, so they overlap compute:

* offload: the side stream waits for the compute stream (``x`` is ready), copies into pinned host
  memory (``non_blocking``) and the device tensor is marked as used by the side stream
  (``record_stream``), so the caching allocator does not hand out its memory before the copy ends;
* reload: the device tensor is allocated on the compute stream, the side stream copies into it
  and the compute stream waits for that copy before the first use. Each reload also *prefetches*:
  it starts the copies of the next :data:`PREFETCH` slots in the order the previous step's
  backward reloaded them, so by the time the backward needs a tensor its copy has run behind the
  compute of the layers before it. A slot whose copy was prefetched is only waited for.

**CPU.** The same ops run and are exact (plain copies): the host copy is memory allocated
outside torch's allocator (a numpy buffer wrapped without copying), which is what the live-tensor
measurement (:class:`~autosp_lm.training.memory.LivePeak`) counts as host memory, and the
prefetch logic runs as on CUDA (copies made early are synchronous).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch.library import custom_op

#: Slots a reload starts copying ahead of time (on CUDA: their H2D copies overlap compute).
PREFETCH = 2

_slots = itertools.count()
_host: dict = {}  # slot -> host tensor (offloaded in this step, not yet reloaded)
_ready: dict = {}  # slot -> (device tensor, event or None): prefetched copies
_order_prev: list = []  # the slots in the order the previous backward reloaded them
_order_now: list = []
_streams: dict = {}


def new_slot() -> int:
    return next(_slots)


def _side_stream(device: torch.device):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device=device)
    return _streams[device]


#: host bytes of the offloaded copies alive now, and the most alive at once since
#: :func:`reset_host_peak` (what the memory planner's host figure is checked against)
host_live_bytes = 0
host_peak_bytes = 0


def _count_host(owner, nbytes: int) -> None:
    global host_live_bytes, host_peak_bytes
    host_live_bytes += nbytes
    host_peak_bytes = max(host_peak_bytes, host_live_bytes)
    weakref.finalize(owner, _release_host, nbytes)


def _release_host(nbytes: int) -> None:
    global host_live_bytes
    host_live_bytes -= nbytes


def reset_host_peak() -> None:
    global host_peak_bytes
    host_peak_bytes = host_live_bytes


def _host_buffer(x: torch.Tensor) -> torch.Tensor:
    nbytes = x.numel() * x.element_size()
    if x.device.type == "cuda":
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        _count_host(out, nbytes)  # (the tensor autograd keeps for the backward)
        return out
    import numpy as np
    # host memory outside torch's CPU allocator; dtypes numpy lacks (bf16) through raw bytes
    raw = np.empty(max(1, nbytes), dtype=np.uint8)
    _count_host(raw, nbytes)  # freed when the last tensor viewing it is
    return torch.from_numpy(raw)[:nbytes].view(x.dtype).view(x.shape)


def _start_copy(slot: int, device: torch.device) -> None:
    """Begin bringing ``slot`` back to ``device`` (asynchronously on CUDA)."""
    host = _host.pop(slot)
    if device.type != "cuda":
        _ready[slot] = (host.clone(), None, host.data_ptr())
        return
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))  # ``out`` is allocated
    with torch.cuda.stream(side):
        out.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    _ready[slot] = (out, event, host.data_ptr())


@custom_op("autosp_lm::offload", mutates_args=())
def offload(x: torch.Tensor, slot: int) -> torch.Tensor:
    global _order_prev, _order_now
    if _order_now:  # the first offload after a backward: a new step
        _order_prev, _order_now = _order_now, []
    host = _host_buffer(x)
    if x.device.type == "cuda":
        side = _side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)
        x.record_stream(side)
    else:
        host.copy_(x)
    _host[slot] = host
    _ready.pop(slot, None)
    return host


@offload.register_fake
def _(x, slot):
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@custom_op("autosp_lm::reload", mutates_args=())
def reload(host: torch.Tensor, slot: int, device: str) -> torch.Tensor:
    dev = torch.device(device)
    _order_now.append(slot)
    if slot in _ready and _ready[slot][2] != host.data_ptr():  # a copy of another step's value
        del _ready[slot]
    if slot not in _ready:
        _host[slot] = host
        _start_copy(slot, dev)
    if slot in _order_prev:  # prefetch the slots the previous step reloaded next
        i = _order_prev.index(slot)
        for nxt in _order_prev[i + 1:i + 1 + PREFETCH]:
            if nxt in _host and nxt not in _ready:
                _start_copy(nxt, dev)
    out, event, _ = _ready.pop(slot)
    if event is not None:
        torch.cuda.current_stream(dev).wait_event(event)
    return out


@reload.register_fake
def _(host, slot, device):
    return torch.empty(host.shape, dtype=host.dtype, device=torch.device(device))


def reset() -> None:
    """Forget every pending copy (tests; after an interrupted step)."""
    _host.clear()
    _ready.clear()
    _order_prev.clear()
    _order_now.clear()


def is_host_copy(t: torch.Tensor) -> bool:
    """A tensor in host memory made by :func:`offload` (pinned on CUDA, outside torch's
    allocator on CPU)."""
    if t.device.type != "cpu":
        return False
    try:
        if t.is_pinned():
            return True
    except RuntimeError:  # pragma: no cover - builds without an accelerator
        pass
    return not t.untyped_storage().resizable()


def host_bytes_of(tensors) -> Optional[int]:
    return sum(t.untyped_storage().nbytes() for t in tensors if is_host_copy(t))
