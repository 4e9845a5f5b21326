"""Inductor's hook classes, made on first use.

Inductor checks that a ``custom_partitioner_fn`` is a ``CustomPartitionerFn``, and importing that
base (``torch._inductor``, which imports Dynamo) takes over a second: a process that never
compiles (the eager strategies, ``pretrain.py --help``, a flag error) should not pay it. A module
therefore writes its hook as a plain class and gets the Inductor subclass from :func:`subclass`
when it first builds one. The subclass is put in the plain class's module under ``name``, so
pickle (which Inductor uses for its cache key) finds it there by name; the module's
``__getattr__`` (PEP 562) makes it on a lookup before any compile did.
"""
from __future__ import annotations

import sys


def subclass(plain: type, name: str) -> type:
    """``plain`` with ``torch._inductor.custom_graph_pass.CustomPartitionerFn`` as a base, named
    ``name`` in ``plain``'s module (made once)."""
    module = sys.modules[plain.__module__]
    cls = module.__dict__.get(name)
    if cls is None:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn
        cls = type(name, (plain, CustomPartitionerFn),
                   {"__module__": plain.__module__, "__qualname__": name, "__doc__": plain.__doc__})
        setattr(module, name, cls)
    return cls


def lazy_getattr(module: str, plains: dict):
    """A module's ``__getattr__`` (PEP 562) that makes ``plains``' Inductor subclasses
    (``{name: plain class}``) on a lookup before any compile made them."""
    def __getattr__(name):
        if name in plains:
            return subclass(plains[name], name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return __getattr__
