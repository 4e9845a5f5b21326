"""build_optimizer off CUDA: torch's fused AdamW, exact against the single-tensor AdamW to fp32
rounding and without the single-tensor path's per-parameter temporaries (plain parameters with
weight-decay groups, and DTensor shards as --use-torch-fsdp2 / --use-distributed-optimizer give)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from autosp_lm.training.memory import LivePeak
from autosp_lm.training.optimizer import build_optimizer, fused_adamw_supported, param_groups

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


class Net(torch.nn.Module):  # matrices (decayed), a norm weight and a bias (not decayed)
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(96, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.fc = torch.nn.Linear(48, 96)


def _steps(model, opt, steps=4):
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_cpu_optimizer_is_fused_and_equals_single_tensor_adamw():
    assert fused_adamw_supported(torch.device("cpu"))
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    opt = build_optimizer(a, weight_decay=0.1, **HYPER)
    assert opt.defaults["fused"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    ref = torch.optim.AdamW(param_groups(b, 0.1), foreach=False, **HYPER)
    got, want = _steps(a, opt), _steps(b, ref)
    for x, y in zip(got, want):
        # fp32 rounding: a few ulp of the parameters (measured: at most 1 ulp after 4 steps)
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_fused_step_allocates_no_temporaries():
    """The single-tensor AdamW's step allocates 2 x the largest parameter (its ``sqrt`` and
    quotient temporaries); the fused step updates in place."""
    def peak(opt_fn):
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 512, bias=False)
        opt = opt_fn(model)
        model.weight.grad = torch.randn_like(model.weight)
        opt.step()  # the first step allocates the moments
        with LivePeak("cpu") as lp:
            opt.step()
        return lp.peak
    size = 512 * 512 * 4
    single = peak(lambda m: torch.optim.AdamW(m.parameters(), foreach=False, **HYPER))
    fused = peak(lambda m: build_optimizer(m, weight_decay=0.1, **HYPER))
    assert single >= 2 * size
    assert fused < size // 100, fused


def test_fused_adamw_on_dtensor_shards_equals_single_tensor_adamw():
    """Shard(0) DTensor parameters (uneven rows too) of a 2-rank mesh, each rank's shard checked
    against the same rows of the single-tensor AdamW on full tensors. The fused update is local
    to the shard, so a fake process group (one process, no communication) runs both ranks."""
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        from autosp_lm.training.optimizer import build_optimizer, param_groups
        HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        shapes = [(64, 32), (17, 8), (32,)]
        torch.manual_seed(0)
        full = [torch.randn(s) for s in shapes]
        grads = [[torch.randn(s, generator=torch.Generator().manual_seed(k)) for s in shapes]
                 for k in range(4)]
        class M(torch.nn.Module):
            def __init__(self, ps):
                super().__init__()
                self.ps = torch.nn.ParameterList(ps)
        ref = M([torch.nn.Parameter(t.clone()) for t in full])
        opt = torch.optim.AdamW(param_groups(ref, 0.1), foreach=False, **HYPER)
        for g in grads:
            for p, x in zip(ref.ps, g):
                p.grad = x.clone()
            opt.step()
        for rank in (0, 1):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
            mesh = init_device_mesh("cpu", (2,))
            def shard(t):  # this rank's rows, as torch.chunk (DTensor's Shard(0)) gives
                return DTensor.from_local(torch.chunk(t, 2)[rank].clone(), mesh, [Shard(0)],
                                          run_check=False, shape=t.shape, stride=t.stride())
            m = M([torch.nn.Parameter(shard(t)) for t in full])
            o = build_optimizer(m, weight_decay=0.1, sharded=True, **HYPER)
            assert o.defaults["fused"] is True
            for g in grads:
                for p, x in zip(m.ps, g):
                    p.grad = shard(x)
                o.step()
            for p, r in zip(m.ps, ref.ps):
                want = torch.chunk(r.detach(), 2)[rank]
                torch.testing.assert_close(p.to_local(), want, rtol=1e-6, atol=1e-7)
            dist.destroy_process_group()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr
