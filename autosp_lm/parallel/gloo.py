"""gloo process groups with one worker thread each (the CPU backend of tests, tools and CPU runs).

torch's ``ProcessGroupGloo`` runs a group's collectives on a pool of worker threads, two by
default, so two asynchronous collectives of one group can run at the same time. Graph FSDP issues
several parameter all-gathers asynchronously (``_c10d_functional.all_gather_into_tensor``, waited
on later), and gloo runs each as a coalesced all-gather. When two of them ran at once while the
ranks reached them at different times, gloo wrote into freed memory: glibc aborted with
``malloc(): unaligned tcache chunk detected`` (or a segfault) in a gloo worker thread. Found in a
2-rank ``pretrain.py --autosp --max-context --use-torch-fsdp2`` run on Inductor, whose ranks
compile the evaluation graph at different speeds; with one rank held back 10 s at that compile,
3 of 4 runs crashed with two worker threads and 0 of 4 with one. torch's own test of async
coalesced all-gathers on gloo was disabled as flaky for a crash of this kind (pytorch#65231).

With one worker thread a group's collectives run one at a time, in the order they were issued,
which every rank agrees on. NCCL is not affected and not touched. Call
:func:`use_single_worker_gloo` before creating gloo groups; it changes nothing on a torch whose
gloo bindings lack the options it needs.
"""
from __future__ import annotations

import torch.distributed as dist

_INSTALLED = False


def use_single_worker_gloo() -> bool:
    """Make every gloo process group created from now on in this process use one worker thread.
    Idempotent; returns whether it is in effect."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if not dist.is_available():
        return False
    from torch.distributed import distributed_c10d as c10d
    base = getattr(c10d, "ProcessGroupGloo", None)
    options = getattr(base, "_Options", None)
    if base is None or options is None or not hasattr(base, "create_default_device") \
            or not hasattr(options(), "_threads"):
        return False

    class SingleWorkerGloo(base):
        """``ProcessGroupGloo`` built with one worker thread (module docstring)."""

        def __init__(self, store, rank, size, timeout_or_options=None, **kwargs):
            opts = kwargs.pop("options", timeout_or_options)
            timeout = kwargs.pop("timeout", None)
            if not isinstance(opts, options):
                timeout = opts if opts is not None else timeout
                opts = options()
                opts._devices = [base.create_default_device()]
                if timeout is not None:
                    opts._timeout = timeout
            opts._threads = 1
            super().__init__(store, rank, size, opts)

    SingleWorkerGloo.__name__ = SingleWorkerGloo.__qualname__ = "ProcessGroupGloo"
    c10d.ProcessGroupGloo = SingleWorkerGloo
    _INSTALLED = True
    return True


def gloo_worker_threads(group=None) -> int | None:
    """The worker threads of ``group``'s gloo backend (None when it has no gloo backend)."""
    import torch
    pg = group if group is not None else dist.group.WORLD
    try:
        backend = pg._get_backend(torch.device("cpu"))
        return int(backend.options._threads)
    except (RuntimeError, AttributeError):
        return None


__all__ = ["use_single_worker_gloo", "gloo_worker_threads"]
