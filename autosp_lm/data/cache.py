"""On-disk caches of index arrays: where they live, how one process builds them while the others
wait (a file lock), atomic writes, and the :class:`IndexCache` of one set of arrays. See
:mod:`.gpt_dataset` for what is cached and the directory rules."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from typing import Callable, Sequence

import numpy as np

CACHE_VERSION = 1


def _hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def user_cache_root() -> str:
    """``$AUTOSP_LM_CACHE`` or ``~/.cache/autosp_lm``."""
    env = os.environ.get("AUTOSP_LM_CACHE")
    return os.path.abspath(os.path.expanduser(env)) if env else \
        os.path.join(os.path.expanduser("~"), ".cache", "autosp_lm")


def default_cache_dir(prefix: str) -> str:
    """Where sample indices of ``prefix`` go when ``--data-cache-path`` is not given."""
    if os.environ.get("AUTOSP_LM_CACHE"):
        return user_cache_root()
    beside = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
    if _writable_dir(beside):
        return beside
    return user_cache_root()


@contextmanager
def file_lock(path: str):
    """An exclusive ``fcntl.flock`` on ``path`` (created if needed) for the ``with`` block."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def atomic_save_npy(path: str, arr: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, path)


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class IndexCache:
    """A set of ``.npy`` arrays named by a hash of ``key``, built once under a file lock."""

    def __init__(self, directory: str, label: str, key: dict, names: Sequence[str],
                 build: Callable[[], dict]):
        self.directory = os.path.abspath(directory)
        self.key = key
        self.hash = _hash(key)
        self.stem = os.path.join(self.directory, f"{label}-{self.hash}")
        self.names = tuple(names)
        self._build = build
        self.built = False  # True when this object built the files

    def path(self, name: str) -> str:
        return f"{self.stem}-{name}.npy"

    @property
    def meta_path(self) -> str:
        return f"{self.stem}-meta.json"

    def complete(self) -> bool:
        return os.path.isfile(self.meta_path) and all(os.path.isfile(self.path(n))
                                                      for n in self.names)

    def ensure(self) -> bool:
        """Build the files unless they exist; returns whether this call built them."""
        if self.complete():
            return False
        if not _writable_dir(self.directory):
            raise PermissionError(f"data cache directory {self.directory} is not writable; "
                                  f"choose another with --data-cache-path")
        with file_lock(self.stem + ".lock"):
            if self.complete():
                return False
            arrays = self._build()
            for n in self.names:
                atomic_save_npy(self.path(n), arrays[n])
            meta = dict(self.key, arrays={n: [list(arrays[n].shape), str(arrays[n].dtype)]
                                          for n in self.names})
            atomic_write_text(self.meta_path, json.dumps(meta, indent=1, sort_keys=True))
        self.built = True
        return True

    def load(self) -> dict:
        if not self.complete():
            raise FileNotFoundError(f"data cache {self.stem}-* is missing (was it deleted while "
                                    f"running?)")
        return {n: np.load(self.path(n), mmap_mode="r", allow_pickle=False) for n in self.names}
