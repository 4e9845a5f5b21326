"""A decoder that installs a forward hook on its first call (as statistics collectors and lazily
attached adapters do): the hook rescales the output projection, so a run without it differs.
``every_call=True`` registers a new hook on every call (a bug AutoSP must refuse clearly).
``lock=True`` installs it under a ``threading.Lock`` (as transformers 5 installs its output
capturing hooks): Dynamo breaks at the lock, before the registration."""
from __future__ import annotations

import threading

import torch
import torch.nn as nn
import torch.nn.functional as F


_INSTALL_LOCK = threading.Lock()  # module-level, as transformers' own


def _rescale(module, inputs, output):
    return output * 0.5


class HookLM(nn.Module):
    def __init__(self, vocab=256, dim=32, heads=4, layers=1, every_call=False, lock=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.heads, self.every_call, self._hooked = heads, every_call, False
        self.lock = lock

    def _install(self):
        self.proj.register_forward_hook(_rescale)
        self._hooked = True

    def forward(self, input_ids, labels):
        if self.every_call or not self._hooked:
            if self.lock:
                with _INSTALL_LOCK:
                    self._install()
            else:
                self._install()
        x = self.emb(input_ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
