"""Graph FSDP without SAC: the joint pass that tags the parameter gathers runs on its own.

One process with a 1-rank process group (the gathers and reduce-scatters are real
``_c10d_functional`` ops of size 1): ``autosp_compile(..., sac=False)`` of a graph-sharded model
re-gathers the parameters in the backward and saves none of them (``reshard_after_forward``), or
keeps them all and re-gathers none (``reshard_after_forward=False``); either way the loss and
every gradient equal the unsharded model's. The dp x sp behaviour (division by dp, 4 ranks) is
tests/training/test_sharded_training.py's.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _model():
    from autosp_lm.models import build_model, preset_config
    torch.manual_seed(0)
    return build_model(preset_config("llama-tiny", num_layers=1))


@pytest.mark.parametrize("reshard", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_gathers_are_tagged_without_sac(one_rank_mesh, reshard):
    from autosp_lm.compiler import autosp_compile
    from autosp_lm.parallel.fsdp_graph import graph_fully_shard, graph_shard_info
    torch._dynamo.reset()
    ref, model = _model(), _model()
    graph_fully_shard(model, one_rank_mesh, dp=1)
    assert graph_shard_info(model).parameters == 12
    run = autosp_compile(model, sac=False, backend="aot_eager", verbose=False,
                         param_sharding="graph_fsdp", reshard_after_forward=reshard)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.config.vocab_size, (2, 32), generator=g)
    labels = torch.roll(ids, -1, 1)
    loss = run(input_ids=ids, labels=labels)
    loss.backward()
    expected = ref(ids, labels=labels)
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        err = float((p.grad.full_tensor() - q.grad).norm() / q.grad.norm())
        assert err < 1e-5, (n, err)
    fsdp = run.report.fsdp
    assert fsdp.enabled and fsdp.gathers == 12 and fsdp.reduce_scatters == 12
    assert not run.report.sac.enabled
    if reshard:  # every parameter the backward needs is gathered again, none is kept
        assert fsdp.saved_gathered == 0 and fsdp.backward_gathers >= 10, fsdp
        assert "re-gathers the parameters it needs" in run.report.text()
    else:
        assert fsdp.backward_gathers == 0 and fsdp.saved_gathered >= 10, fsdp
        assert "gathered once" in run.report.text()
