"""autosp_lm.training.memory: saved-for-backward byte counts and peak-memory helpers."""
import torch

from autosp_lm.training.memory import (SavedTensorBytes, cuda_peak_delta, peak_rss_delta,
                                       read_vm_hwm, saved_bytes)


def test_counts_each_storage_once():
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorBytes() as m:
        y = (x * x).sum()  # mul saves x twice: one storage
    assert m.count == 1 and m.bytes == 4000
    y.backward()


def test_exclude_and_views():
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    with SavedTensorBytes(exclude=[w]) as m:
        y = (x @ w).relu()
    # x saved by the matmul, relu's output saved by relu; the weight is excluded.
    assert m.bytes == x.nbytes + y.nbytes
    _, b = saved_bytes(lambda: (x.t()[:16] @ w[:8]).sum())  # views of x and w share storages
    assert b == x.nbytes + w.nbytes


def test_compiled_graph_saves_through_hooks():
    torch._dynamo.reset()
    lin = torch.nn.Linear(32, 32)

    def f(x):
        return torch.tanh(lin(x)).sum()

    x = torch.randn(16, 32)
    _, eager = saved_bytes(f, x, exclude=lin)
    cf = torch.compile(f, backend="aot_eager")
    for _ in range(2):
        out, compiled = saved_bytes(cf, x, exclude=lin)
        out.backward()
    assert eager > 0 and compiled > 0
    # tanh's output [16, 32] must be among what the compiled graph saves.
    assert compiled >= 16 * 32 * 4


def test_peak_helpers_degrade_gracefully():
    res, delta = peak_rss_delta(lambda: torch.ones(1 << 20).sum().item())
    assert res == float(1 << 20)
    assert delta is None or delta >= 0
    hwm = read_vm_hwm()
    assert hwm is None or hwm > 0
    res, cdelta = cuda_peak_delta(lambda: 3)
    assert res == 3
    if not torch.cuda.is_available():
        assert cdelta is None


def test_fake_tensors_saved_while_tracing_are_not_counted():
    """A compiler tracing on the first call runs autograd contexts on fake tensors: no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.randn(1000, 1000, requires_grad=True)
    real = torch.randn(10, requires_grad=True)
    with SavedTensorBytes() as m:
        with FakeTensorMode(allow_non_fake_inputs=True):
            (fake * fake).sum()
        y = (real * real).sum()
    y.backward()
    assert m.bytes == 10 * 4 and m.count == 1


def test_live_peak_is_exact_on_cpu():
    """LivePeak counts every allocation and free of torch's CPU allocator inside the block: the
    peak of live bytes above the start, to the byte, whatever malloc caches; also through a
    compiled graph (Inductor/aot_eager buffers come from the same allocator)."""
    from autosp_lm.training.memory import LivePeak, peak_live_bytes
    kept = torch.empty(1 << 20, dtype=torch.uint8)  # live before: not part of the figure
    with LivePeak() as m:
        a = torch.empty(3_000_000, dtype=torch.uint8)
        b = torch.empty(500_000, dtype=torch.float32)  # 2 MB
        del a
        c = torch.empty(1_000_000, dtype=torch.uint8)
        del c
    assert (m.peak, m.end, m.method) == (5_000_000, 2_000_000, "cpu-allocator")
    del b, kept
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2 + 1).sum(), backend="aot_eager")
    x = torch.randn(1 << 16)
    f(x)
    # x * 2 and + 1 are two live [65536] fp32 buffers at most, plus the scalar
    _, peak = peak_live_bytes(f, x)
    assert 4 * (1 << 16) <= peak <= 2 * 4 * (1 << 16) + 64


def test_live_peak_sees_every_threads_frees():
    """A tensor whose last reference another thread drops (gloo's worker thread and a
    collective's send buffer) is freed in the figure: the allocator's running total would
    otherwise keep it, and a real SP run's peak moved from run to run with that race. Held by
    another thread, it counts as live."""
    import threading

    from autosp_lm.training.memory import LivePeak
    with LivePeak() as m:
        box = [torch.empty(1_000_000, dtype=torch.uint8)]
        t = threading.Thread(target=box.clear)  # the last reference dropped on another thread
        t.start()
        t.join()
        b = torch.empty(3_000_000, dtype=torch.uint8)
        del b
    assert (m.peak, m.end, m.method) == (3_000_000, 0, "cpu-allocator")
    started, done = threading.Event(), threading.Event()
    held = []

    def hold():
        held.append(torch.empty(2_000_000, dtype=torch.uint8))
        started.set()
        done.wait()
        held.clear()

    with LivePeak() as m:
        t = threading.Thread(target=hold)
        t.start()
        started.wait()
        a = torch.empty(1_000_000, dtype=torch.uint8)
        del a
        done.set()
        t.join()
    assert (m.peak, m.end) == (3_000_000, 0)
