"""The ``autosp_kernels`` section: AutoSP on the kernels a GPU run executes, as one rank of a
2-rank SP job (a fake process group: the collectives return meaningless values, so this cell
checks what runs, not the numbers; exactness is tested on CPU with stand-ins of the same ops,
tests/compiler/test_kernels.py).

Per model, one bf16 training step after a warm-up: the compile report's fallbacks and forward
collectives, and the attention kernels CUDA ran (``torch.profiler``):

* ``llama-tiny (SDPA)``: our model; SDPA picks its FlashAttention (or cuDNN / efficient)
  backend inside the Ulysses all-to-alls;
* ``flash_attn_func`` (only with the ``flash_attn`` package): a block calling FlashAttention 2
  as users do. AutoSP's built-in registration keys on its ``flash_attn::_flash_attn_forward`` op;
  if the package's autograd wrapper hides the op from the graph, the row shows the fallback.

``--smoke``: the same on CPU with aot_eager (no kernel names).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from .common import Row, init_fake_world, run_one_cell

EST_S = 90.0  # two Inductor compiles of tiny models and two steps, on one H100 (estimate)


class _FlashBlock(nn.Module):
    """Embedding, one attention block calling ``flash_attn_func``, a head and the loss."""

    def __init__(self, vocab=256, dim=256, heads=4):
        super().__init__()
        self.emb, self.qkv = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim)
        self.proj, self.head, self.heads = nn.Linear(dim, dim), nn.Linear(dim, vocab), heads

    def forward(self, input_ids, labels):
        from flash_attn import flash_attn_func
        x = self.emb(input_ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(flash_attn_func(q, k, v, causal=True).reshape(b, s, d))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _models(device):
    from autosp_lm.models import build_model, preset_config
    out = {"llama-tiny (SDPA)": lambda: build_model(preset_config("llama-tiny")).to(device)}
    try:
        import flash_attn  # noqa: F401
        out["flash_attn_func"] = lambda: _FlashBlock().to(device)
    except ImportError:
        out["flash_attn_func"] = None
    return out


def kernels_worker(cell: dict) -> dict:
    from autosp_lm.compiler import autosp_compile
    init_fake_world(2)
    device = torch.device(cell["device"])
    out = {}
    for name, make in _models(device).items():
        if make is None:
            out[name] = {"skipped": "the flash_attn package is not installed"}
            continue
        try:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = make()
            run = autosp_compile(model, backend=cell["backend"], verbose=False)
            ids = torch.randint(0, 256, (1, cell["seq"]), device=device)

            def step():
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = run(input_ids=ids, labels=ids)
                loss.backward()
            t = time.perf_counter()
            step()
            first = time.perf_counter() - t
            kernels = []
            if device.type == "cuda":
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                kernels = sorted({e.key for e in prof.key_averages()
                                  if any(w in e.key.lower() for w in ("flash", "fmha", "cudnn",
                                                                      "attention"))})
            rep = run.report.as_dict()
            out[name] = {"fallbacks": [f"{f['op']}: {f['reason'][:80]}" for f in rep["fallbacks"]],
                         "forward": rep["collectives_forward"], "kernels": kernels[:6],
                         "first_step_s": first}
        except Exception as e:  # noqa: BLE001 - the row says what failed
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def section_autosp_kernels(args, deadline):
    cell = dict(worker="autosp_kernels", device="cpu" if args.smoke else "cuda",
                backend="aot_eager" if args.smoke else "inductor",
                seq=256 if args.smoke else 8192, est_s=20.0 if args.smoke else EST_S)
    row, results = run_one_cell("autosp_kernels", "models", cell, args, deadline)
    if row is not None:
        yield row
        return
    for name, r in results.items():
        if "skipped" in r or "error" in r:
            yield Row("autosp_kernels", name, "skipped" if "skipped" in r else "FAIL",
                      r.get("skipped") or r["error"])
            continue
        gathers = r["forward"].get("all_gather", 0)
        ran = bool(r["kernels"]) or args.smoke
        ok = not r["fallbacks"] and not gathers and ran
        note = (f"fallbacks {len(r['fallbacks'])}, all_gathers {gathers}; attention kernels: "
                f"{', '.join(r['kernels']) or '-'}"
                + (f"; {'; '.join(r['fallbacks'][:2])}" if r["fallbacks"] else ""))
        yield Row("autosp_kernels", name, "ok" if ok else "FAIL", note,
                  cell_s=r["first_step_s"])
