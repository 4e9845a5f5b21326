"""Activation-memory measurement for tests and tools.

* :class:`SavedTensorBytes` / :func:`saved_bytes` count the bytes saved for backward during a
  forward, once per storage, through ``torch.autograd.graph.saved_tensors_hooks``. Deterministic
  on CPU. Graphs compiled by AOTAutograd save their activations with ``ctx.save_for_backward``,
  which runs the hooks, so compiled and eager runs are measured alike. Not seen: values a compiled
  graph stashes on ``ctx`` without ``save_for_backward`` (symbolic ints, opaque objects and, in
  recent torch, tensors tagged ``saved_tensor_with_no_vc_check``); plain single-device GPT/Llama
  graphs have none of the latter.
* :class:`LivePeak` / :func:`peak_live_bytes` measure the peak of *live tensor memory* during a
  block, above what was live when it started: exact on CPU (every allocation and free of torch's
  CPU allocator, from the profiler's memory events) and ``torch.cuda.max_memory_allocated`` on
  CUDA. This is what decides the longest context; see the class for why it is exact.
* :func:`peak_rss_delta` measures the growth of the process's peak resident memory over one call
  (CPU; Linux ``/proc``; coarse: the C allocator keeps freed memory), and :func:`cuda_peak_delta`
  the CUDA allocator's peak over one call.
"""
from __future__ import annotations

import gc
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["SavedTensorBytes", "saved_bytes", "LivePeak", "peak_live_bytes", "peak_rss_delta",
           "cuda_peak_delta", "read_vm_hwm"]


def _storage_key(t: torch.Tensor):
    try:
        st = t.untyped_storage()
        return (str(t.device), st.data_ptr()), st.nbytes()
    except Exception:  # tensor subclasses without storage
        return (str(t.device), id(t)), t.numel() * t.element_size()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    try:
        return bool(is_fake(t))
    except Exception:  # noqa: BLE001 - unusual subclasses: count them
        return False


def _in_host_memory(t: torch.Tensor) -> bool:
    """A CPU tensor in memory outside torch's CPU allocator or pinned: what activation offload
    keeps its host copies in (pinned memory on CUDA; on CPU a buffer torch did not allocate,
    whose storage therefore cannot be resized)."""
    if t.device.type != "cpu":
        return False
    try:
        if t.is_pinned():
            return True
    except RuntimeError:  # builds without an accelerator
        pass
    try:
        return not t.untyped_storage().resizable()
    except Exception:  # noqa: BLE001 - tensor subclasses without storage
        return False


def _iter_tensors(objs: Any) -> Iterable[torch.Tensor]:
    if objs is None:
        return
    if isinstance(objs, torch.Tensor):
        yield objs
    elif isinstance(objs, torch.nn.Module):
        yield from objs.parameters()
        yield from objs.buffers()
    else:
        for o in objs:
            yield from _iter_tensors(o)


class SavedTensorBytes:
    """Context manager counting the bytes saved for backward inside it, once per storage.

    ``exclude``: tensors or modules (their parameters and buffers) whose storages are not counted,
    e.g. the model's weights, which backward keeps anyway. After the block: ``bytes`` (total),
    ``count`` (distinct storages), ``storages`` (key -> bytes), ``host_bytes`` (of those, the
    storages in host memory: activation offload's copies, see :func:`_in_host_memory`) and
    ``device_bytes`` (the rest: what stays on the device between forward and backward).

    Usage::

        with SavedTensorBytes(exclude=model) as m:
            loss = compiled(ids, labels=ids)
        loss.backward(); print(m.bytes)
    """

    def __init__(self, exclude: Any = None):
        self._exclude = {_storage_key(t)[0] for t in _iter_tensors(exclude)}
        self.storages: dict = {}
        self.host_storages: set = set()
        self._ctx = None

    def _pack(self, t):
        # Tensors saved while a compiler traces the program (fake or meta values, e.g. a custom
        # op's autograd context during AOTAutograd's trace on the first call) hold no memory.
        if isinstance(t, torch.Tensor) and not _is_fake(t) and t.device.type != "meta":
            key, nbytes = _storage_key(t)
            if key not in self._exclude and key not in self.storages:
                self.storages[key] = nbytes
                if _in_host_memory(t):
                    self.host_storages.add(key)
        return t

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self) -> "SavedTensorBytes":
        self.storages = {}
        self.host_storages = set()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self._ctx = None

    @property
    def bytes(self) -> int:
        return int(sum(self.storages.values()))

    @property
    def host_bytes(self) -> int:
        return int(sum(self.storages[k] for k in self.host_storages))

    @property
    def device_bytes(self) -> int:
        return self.bytes - self.host_bytes

    @property
    def count(self) -> int:
        return len(self.storages)


def saved_bytes(fn: Callable, *args, exclude: Any = None, **kwargs) -> tuple[Any, int]:
    """Call ``fn(*args, **kwargs)`` and return ``(result, bytes saved for backward)``."""
    with SavedTensorBytes(exclude=exclude) as m:
        result = fn(*args, **kwargs)
    return result, m.bytes


class LivePeak:
    """Context manager: the peak of live tensor memory inside the block, above its start.

    After the block: ``peak`` (bytes above the live memory at entry), ``end`` (bytes still live
    at exit that were allocated inside, e.g. gradients), ``method`` (``"cpu-allocator"`` or
    ``"cuda"``), on CUDA also ``start`` (``memory_allocated`` at entry) and ``absolute_peak``
    (``max_memory_allocated``).

    **CPU: exact.** While the profiler records memory (``profile_memory=True``), torch's CPU
    allocator (``c10::ProfiledCPUMemoryReporter``) reports every allocation and every free with
    its size and the running total of the bytes it has handed out since the recording began. All
    CPU tensors come from that allocator: eager kernels, Inductor's generated code (its buffers
    are ``empty_strided`` calls), custom ops, collective outputs, kernels' scratch tensors. So
    the maximum of the running total over the block, minus its value at entry, is the peak of
    live tensor bytes to the byte, independent of how ``malloc`` caches freed memory (which is
    why the resident-set peak barely moves on small models).

    **Every thread's frees.** The allocator keeps its running total only for threads that the
    profiler records, unless c10's flag ``caffe2_report_cpu_memory_usage`` is set: without it a
    tensor that another thread frees (gloo's worker thread drops the last reference to a
    collective's send buffer after the caller has returned, a race) is never subtracted, and the
    total drifts upward by the buffers it happened to (measured: 20 all-to-alls of 8 MiB on 2
    gloo ranks, the block ending 0-56 MiB above its start, its peak 32-80 MiB instead of 24).
    :class:`LivePeak` sets that flag (a plain global of ``libc10``, through ``ctypes``) the first
    time it measures CPU memory and leaves it set for the process, so that no allocation made
    while it was set is freed after it was cleared (a stale entry would drift the total again);
    the cost is a locked table update per CPU allocation. Where the symbol cannot be found the
    method is ``"cpu-allocator-this-thread"``: an upper bound. With the flag the total counts
    every thread's tensors, a worker's own buffers included, but a worker's allocation freed
    between two events of the measuring thread is not seen. Not seen either: memory allocated outside
    torch's allocator (a communication library's own buffers, numpy arrays, which is where
    activation offload keeps its CPU-side copies: host memory, as pinned memory is on CUDA), and
    frees of tensors allocated before the block (they can only lower the true figure: the
    reported peak is then an upper bound; a training step frees none once gradients were
    zeroed with ``set_to_none``).

    **CUDA**: ``max_memory_allocated - memory_allocated`` at entry (the caching allocator's own
    count of live tensor bytes, rounded to its 512-byte blocks).
    """

    def __init__(self, device: Any = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak: Optional[int] = None
        self.end: Optional[int] = None
        self.start: Optional[int] = None
        self.absolute_peak: Optional[int] = None
        self.method = "cuda" if self.device.type == "cuda" else "cpu-allocator"
        self._prof = None

    def __enter__(self) -> "LivePeak":
        gc.collect()
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile
        if not _count_every_thread():
            self.method = "cpu-allocator-this-thread"
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             record_shapes=False, with_stack=False)
        self._prof.__enter__()
        marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)  # the first event: the start
        del marker
        return self

    def __exit__(self, *exc) -> None:
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            self.absolute_peak = torch.cuda.max_memory_allocated(self.device)
            self.peak = self.absolute_peak - self.start
            self.end = torch.cuda.memory_allocated(self.device) - self.start
            return
        marker = torch.empty(_END_MARKER_BYTES, dtype=torch.uint8)  # the total at exit
        del marker
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak, self.end = _cpu_allocation_peak(self._prof)
        self._prof = None


_MARKER_BYTES = 64
_END_MARKER_BYTES = 96
_EVERY_THREAD: Optional[bool] = None


def _count_every_thread() -> bool:
    """Set c10's ``caffe2_report_cpu_memory_usage`` (once per process; see :class:`LivePeak`) so
    that the CPU allocator's running total subtracts frees made on every thread. False where the
    flag cannot be found in ``libc10``."""
    global _EVERY_THREAD
    if _EVERY_THREAD is None:
        import ctypes
        import glob
        import os
        _EVERY_THREAD = False
        libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))
        for path in libs:
            try:
                flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
            except (OSError, ValueError):
                continue
            flag.value = True
            _EVERY_THREAD = True
            break
    return _EVERY_THREAD


def _cpu_allocation_peak(prof) -> tuple[int, int]:
    """(peak, end) of the running total of CPU allocations in a profile, above its start (the
    running total before the marker allocation that :class:`LivePeak` makes first); the end is
    read at the marker it allocates last (a free made by another thread after the block's last
    recorded event is then included)."""
    from torch._C._profiler import _EventType
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu" and f.alloc_size != 0:
                events.append((e.start_time_ns, f.alloc_size, f.total_allocated))
        stack.extend(e.children)
    if not events:
        return 0, 0
    events.sort(key=lambda e: e[0])
    i = next((i for i, e in enumerate(events) if e[1] == _MARKER_BYTES), None)
    if i is None:  # pragma: no cover - the marker is always recorded
        i = -2
        start = events[0][2] - events[0][1]
    else:
        start = events[i][2] - events[i][1]
    rest = events[i + 2:]  # after the marker's allocation and free
    j = next((j for j in range(len(rest) - 1, -1, -1) if rest[j][1] == _END_MARKER_BYTES), None)
    if j is not None:
        end = rest[j][2] - _END_MARKER_BYTES
        rest = rest[:j]
    else:  # pragma: no cover - the end marker is always recorded
        end = rest[-1][2] if rest else start
    peak = max([start, end] + [e[2] for e in rest])
    return max(0, int(peak - start)), int(end - start)


def peak_live_bytes(fn: Callable, *args, device: Any = None, **kwargs) -> tuple[Any, int]:
    """Call ``fn(*args, **kwargs)`` and return ``(result, peak live tensor bytes above the
    start)`` (:class:`LivePeak`; ``device``: the device whose memory is measured, default CPU)."""
    with LivePeak(device) as m:
        result = fn(*args, **kwargs)
    return result, m.peak


class HostBytesAfterForward:
    """Context manager around a forward (``forward_backward``'s ``saved_counter``): ``bytes``,
    the host memory held by activations offloaded during it, measured when it ends (the most
    they hold: the backward only frees them), independently of the offload ops' own counter.

    **CPU**: the offload ops keep their host copies in numpy buffers (outside torch's
    allocator), and numpy reports every buffer it allocates to :mod:`tracemalloc` in a domain of
    its own (``numpy.lib.tracemalloc_domain``): the bytes of that domain live at the end, above
    those at the start (tracing runs inside the block only, started here if it was off).
    **CUDA**: pinned host memory comes from torch's caching host allocator:
    ``torch.cuda.host_memory_stats()``'s allocated bytes now above those at the start. ``None``
    where neither can be read."""

    def __init__(self, device: Any = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.bytes: Optional[int] = None
        self._start = 0
        self._started = False

    @staticmethod
    def _numpy_bytes() -> int:
        import tracemalloc

        import numpy as np
        domain = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
        return sum(s.size for s in tracemalloc.take_snapshot().filter_traces([domain]).traces)

    @staticmethod
    def _pinned_bytes() -> Optional[int]:
        try:
            return int(torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0))
        except (AttributeError, RuntimeError):
            return None

    def __enter__(self) -> "HostBytesAfterForward":
        if self.device.type == "cuda":
            self._start = self._pinned_bytes()
            return self
        import tracemalloc
        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start()
        self._start = self._numpy_bytes()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            now = self._pinned_bytes()
            self.bytes = None if now is None or self._start is None else now - self._start
            return
        import tracemalloc
        self.bytes = self._numpy_bytes() - self._start
        if self._started:
            tracemalloc.stop()


def _read_status(field: str) -> Optional[int]:
    """A size field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def read_vm_hwm() -> Optional[int]:
    """The process's peak resident set size in bytes (``VmHWM``), or None if unavailable."""
    return _read_status("VmHWM")


def _read_vm_rss() -> Optional[int]:
    return _read_status("VmRSS")


def _reset_vm_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_free_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``) so that the resident set
    before a measured call is not inflated by memory the allocator kept from earlier calls;
    without it a steady-state step reuses that memory and its measured peak is close to 0."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_delta(fn: Callable, *args, **kwargs) -> tuple[Any, Optional[int]]:
    """Call ``fn`` and return ``(result, peak RSS during the call - RSS before it)`` in bytes.

    Resets the kernel's high-water mark by writing ``5`` to ``/proc/self/clear_refs``; returns
    ``None`` for the delta where that is not possible (non-Linux, restricted ``/proc``). Noisy
    compared with :class:`SavedTensorBytes` (allocator caching, other threads): for reports, not
    assertions.
    """
    gc.collect()
    _release_free_heap()
    if not _reset_vm_hwm():
        return fn(*args, **kwargs), None
    before = _read_vm_rss()
    result = fn(*args, **kwargs)
    peak = read_vm_hwm()
    if before is None or peak is None:
        return result, None
    return result, max(0, peak - before)


def cuda_peak_delta(fn: Callable, *args, device: Any = None, **kwargs) -> tuple[Any, Optional[int]]:
    """Call ``fn`` and return ``(result, max_memory_allocated during the call - allocated
    before)`` on CUDA; ``None`` for the delta without CUDA."""
    if not torch.cuda.is_available():
        return fn(*args, **kwargs), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - before
