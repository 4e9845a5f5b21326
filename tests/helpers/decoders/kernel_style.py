"""A decoder whose heavy ops are opaque kernels, called the way their packages call them
(tests/helpers/kernels_standin.py defines them): FlashAttention 2's forward op (padded batch or
packed documents with ``cu_seqlens``), a per-head gated recurrence, a fused SwiGLU and a fused
linear cross-entropy. Written functionally: a flat ParameterDict and one forward."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def decay_scan_py(x, decay, A):
    """The per-head recurrence ``h_t = decay_t * h_{t-1} + A * x_t`` as a plain Python function
    in PyTorch (a research kernel), in its quadratic form: ``h_t = sum_{j <= t} exp(L_t - L_j) A
    x_j`` with ``L`` the cumulative log decay; no loop over the sequence."""
    s = x.shape[1]
    log = torch.cumsum(torch.log(decay), dim=1).transpose(1, 2)  # [B, H, S]
    diff = log[..., :, None] - log[..., None, :]  # [B, H, S, S]
    causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    w = torch.where(causal, diff, float("-inf")).exp()
    return torch.einsum("bhts,bshd->bthd", w, x * A[None, None, :, None])


class KernelLM(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, kv_heads=2, ffn=48, layers=1, varlen=False,
                 window=-1, python_scan=False):
        super().__init__()
        self.cfg = dict(dim=dim, heads=heads, kv=kv_heads, hd=dim // heads, layers=layers,
                        varlen=varlen, window=window, python_scan=python_scan)
        g = torch.Generator().manual_seed(0)

        def w(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) * shape[0] ** -0.5)
        p = {"emb": w(vocab, dim), "lm": w(vocab, dim)}
        for i in range(layers):
            hd = dim // heads
            p.update({f"n1_{i}": nn.Parameter(torch.ones(dim)), f"q_{i}": w(dim, dim),
                      f"k_{i}": w(dim, kv_heads * hd), f"v_{i}": w(dim, kv_heads * hd),
                      f"o_{i}": w(dim, dim), f"n2_{i}": nn.Parameter(torch.ones(dim)),
                      f"u_{i}": w(dim, dim), f"d_{i}": w(dim, heads),
                      f"A_{i}": nn.Parameter(torch.linspace(0.5, 1.5, heads)),
                      f"so_{i}": w(dim, dim), f"n3_{i}": nn.Parameter(torch.ones(dim)),
                      f"in_{i}": w(dim, 2 * ffn), f"out_{i}": w(ffn, dim)})
        self.p = nn.ParameterDict(p)

    def attend(self, h, i, cu_seqlens):
        c, p = self.cfg, self.p
        b, s, _ = h.shape
        q = (h @ p[f"q_{i}"]).view(b, s, c["heads"], c["hd"])
        k = (h @ p[f"k_{i}"]).view(b, s, c["kv"], c["hd"])
        v = (h @ p[f"v_{i}"]).view(b, s, c["kv"], c["hd"])
        scale = c["hd"] ** -0.5
        if c["varlen"]:  # one packed row: (total tokens, heads, head dim)
            o = torch.ops.flash_attn._flash_attn_varlen_forward(
                q[0], k[0], v[0], cu_seqlens, cu_seqlens, s, s, 0.0, scale, True,
                c["window"], 0)[0][None]
        else:
            o = torch.ops.flash_attn._flash_attn_forward(q, k, v, 0.0, scale, True, c["window"],
                                                         0, 0.0, None, False)[0]
        return o.reshape(b, s, -1) @ p[f"o_{i}"]

    def forward(self, input_ids, labels, cu_seqlens=None):
        c, p = self.cfg, self.p
        x = F.embedding(input_ids, p["emb"])
        b, s, d = x.shape
        for i in range(c["layers"]):
            x = x + self.attend(F.rms_norm(x, (d,), p[f"n1_{i}"]), i, cu_seqlens)
            h = F.rms_norm(x, (d,), p[f"n2_{i}"])
            u = (h @ p[f"u_{i}"]).view(b, s, c["heads"], c["hd"])
            decay = torch.sigmoid(h @ p[f"d_{i}"])
            scan = decay_scan_py if c["python_scan"] else torch.ops.standin.decay_scan
            y = scan(u, decay, p[f"A_{i}"])
            x = x + y.reshape(b, s, d) @ p[f"so_{i}"]
            h = F.rms_norm(x, (d,), p[f"n3_{i}"])
            x = x + torch.ops.standin.swiglu(h @ p[f"in_{i}"]) @ p[f"out_{i}"]
        return torch.ops.standin.linear_cross_entropy(
            x[:, :-1].reshape(-1, d), p["lm"], labels[:, 1:].reshape(-1), -100, "mean")
