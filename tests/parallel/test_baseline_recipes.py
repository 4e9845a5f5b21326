"""The memory techniques of the hand-written strategies (``autosp_lm/strategies/memory.py``):
Megatron's full / selective recomputation, the chunked loss head, the tiled MLP and the offload
of the checkpointed block inputs, for none, ``--ulysses`` and ``--ring``.

Exactness: loss and every SP-summed gradient against one device, fp32, 1e-5 relative
(``tests/helpers/baseline_parity.py``), on 2 ranks, eager and compiled (aot_eager here; Inductor
in ``tests/training/test_bf16.py``'s matrix), and under ``-m slow`` the compiled none strategy and
SP 4 / DP 2 x SP 2 in launches of their own. The recipes only move where activations live, so
anything beyond fp32 reduction-order rounding is a bug.

Memory: that each technique really drops what it claims is checked on one process from the
tensors autograd saves (``saved_tensors_hooks``, deterministic) and the op outputs of a step
(a ``TorchDispatchMode``), not from timings.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from autosp_lm.models import build_model, preset_config
from autosp_lm.strategies import build_strategy
from autosp_lm.strategies.memory import MemoryRecipe, RecipeOptions, check_recipe
from tests.helpers.baseline_parity import check_parity
from tests.helpers.launch import Job

PARITY = "tests.helpers.baseline_parity:parity_worker"
AC = dict(recompute_granularity="full", chunked_loss=True)
ALST = dict(AC, tiled_mlp=True, tiled_mlp_chunk_tokens=8, cpu_offloading=True)
L3 = dict(model="llama-tiny", layers=3, seq=64)
L2 = dict(L3, layers=2)  # compiled: two blocks show the prefetch order, a third only compiles longer

U2 = Job(PARITY, ("ulysses", [
    dict(name="ulysses+ac", sp=2, options=AC, positions=True, **L3),
    dict(name="ulysses+alst", sp=2, options=ALST, **L3),
    dict(name="ulysses selective", sp=2, options=dict(recompute_granularity="selective"), **L3),
    dict(name="ulysses uniform 2 + offload 1", sp=2, options=dict(
        recompute_granularity="full", recompute_num_layers=2, cpu_offloading=True,
        cpu_offloading_num_layers=1), **L3),
    dict(name="gpt ulysses+alst", model="gpt-tiny", sp=2, seq=64, options=ALST),
    # compiled, the offload runs as offload ops in the graph; the second step reloads with
    # prefetching in the first step's order
    dict(name="ulysses+alst compiled", sp=2, compile=True, steps=2, options=ALST, **L2),
]))
R2 = Job(PARITY, ("ring", [
    dict(name="ring+alst", sp=2, options=ALST, **L3),
    dict(name="ring block 2", sp=2, options=dict(recompute_granularity="full",
                                                 recompute_method="block",
                                                 recompute_num_layers=2), **L3),
    dict(name="ring selective", sp=2, options=dict(recompute_granularity="selective"), **L3),
    dict(name="ring+ac compiled", sp=2, compile=True, options=AC, **L2),
]))
N2 = Job(PARITY, ("none", [
    dict(name="none+alst (dp 2)", sp=1, ignore_ranks=(), options=ALST, **L3),
]))
# -m slow: the none strategy's recipe compiled on 2 ranks (by default: on one process in
# test_compiled_offload_moves_each_block_input_once, exact against eager)
N2_SLOW = ("none", [
    dict(name="none+ac compiled (dp 2)", sp=1, ignore_ranks=(), compile=True, options=AC, **L3),
])
# -m slow: the recipes at SP 4 and DP 2 x SP 2 (rank-local: what they move does not depend on
# the world size; the default suite's 4-rank parity is tests/parallel/test_ulysses.py's,
# test_ring.py's and test_upipe.py's)
U4 = ("ulysses", [
    dict(name="ulysses+alst sp4", sp=4, options=ALST, ignore_ranks=(0, 3), **L3),
    dict(name="ulysses+ac compiled sp4", sp=4, compile=True, options=AC, **L3),
])
R4 = ("ring", [
    dict(name="ring+alst dp2 x sp2", sp=2, options=ALST, **L3),
])
FSDP_GROUPS = Job("tests.parallel.test_baseline_recipes:fsdp_groups_worker")
LAUNCH = {2: [U2, R2, N2, FSDP_GROUPS]}


@pytest.mark.parametrize("job", [U2, R2, N2], ids=["ulysses", "ring", "none"])
def test_recipes_are_exact_on_2_ranks(launch2, job):
    by_name = check_parity(launch2(job), 2)
    reports = {n: rs[0]["report"] or "" for n, rs in by_name.items()}
    assert "full recomputation" in reports.get("ulysses+alst", reports.get("ring+alst", "")) or \
        "full recomputation" in reports.get("none+alst (dp 2)", "")


@pytest.mark.slow
@pytest.mark.parametrize("world, jobs", [(2, [N2_SLOW]), (4, [U4, R4])],
                         ids=["none compiled", "sp4"])
def test_more_recipes_are_exact(world, jobs):
    from tests.helpers.baseline_parity import parity_worker
    from tests.helpers.dist import run_distributed
    for strategy, configs in jobs:
        check_parity(run_distributed(parity_worker, world, strategy, configs), world)


def fsdp_groups_worker(rank, world):
    """A group of several blocks per checkpoint under FSDP2's per-block units is refused."""
    from autosp_lm.parallel.sharding_kinds import build_sharding
    from autosp_lm.parallel.state import init_parallel
    ps = init_parallel(2, shard_mesh=True)
    torch.manual_seed(0)
    model = build_model(preset_config("llama-tiny", num_layers=2))
    build_sharding("fsdp2", ps).wrap(model)
    strategy = build_strategy("ulysses", ps, recompute_granularity="full", recompute_num_layers=2)
    try:
        strategy.setup(model)
    except ValueError as e:
        return str(e)
    return None


def test_grouped_checkpoints_under_fsdp2_are_refused(launch2):
    for msg in launch2(FSDP_GROUPS):
        assert msg and "--recompute-num-layers 1" in msg and "FSDP2" in msg, msg


# ------------------------------------------------------------------------- one process
def _model(layers=3, **over):
    torch.manual_seed(0)
    return build_model(preset_config("llama-tiny", num_layers=layers, **over))


def _batch(seq, vocab=512, batch=1):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1),
            "position_ids": torch.arange(seq)[None]}


def _none(model, **options):
    from autosp_lm.parallel.state import init_parallel
    s = build_strategy("none", init_parallel(1, device="cpu"), **options)
    s.setup(model)
    return s


def _saved(strategy, batch):
    """Shapes of the tensors autograd keeps for the backward of one step (outside checkpoints:
    what a checkpoint keeps is its inputs)."""
    shapes = []

    def pack(t):
        shapes.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = strategy.forward_loss(batch)
    loss.backward()
    return shapes


class _Outputs(TorchDispatchMode):
    """The shape of every op output of a step."""

    def __init__(self):
        super().__init__()
        self.shapes = []
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_full_recomputation_keeps_only_the_block_inputs():
    S, H = 256, 64
    batch = _batch(S)
    plain = _saved(_none(_model()), batch)
    full = _saved(_none(_model(), recompute_granularity="full"), batch)
    hidden = [s for s, _ in full if s == (1, S, H)]
    # three block inputs and the final norm's three (its input, its normalised fp32 value, the
    # output projection's input): nothing of a block's inside
    assert len(hidden) == 3 + 3, full
    assert not [s for s, _ in full if s and s[-1] == 192], "an MLP intermediate was kept"
    assert sum(1 for s, _ in plain if s == (1, S, H)) > 3 * len(hidden)
    # uniform groups of 3 blocks: one input kept for all three
    grouped = _saved(_none(_model(), recompute_granularity="full", recompute_num_layers=3), batch)
    assert sum(1 for s, _ in grouped if s == (1, S, H)) == len(hidden) - 2
    # block method, first block only: the other two keep their activations
    block = _saved(_none(_model(), recompute_granularity="full", recompute_method="block"), batch)
    assert len(full) < len(block) < len(plain)


def test_selective_recomputation_drops_the_attention_core():
    S = 256
    batch = _batch(S)
    plain = _saved(_none(_model()), batch)
    sel = _saved(_none(_model(), recompute_granularity="selective"), batch)
    # the attention's output (and its log-sum-exp) are no longer kept: 2 per layer fewer
    assert len(plain) - len(sel) >= 3, (len(plain), len(sel))


def test_chunked_loss_never_builds_the_logits():
    S, V = 4096, 512
    batch = _batch(S)
    for options, whole in (({}, True), ({"chunked_loss": True}, False)):
        strategy = _none(_model(layers=1), **options)
        with _Outputs() as mode:
            loss, _ = strategy.forward_loss(batch)
            loss.backward()
        widest = max([torch.Size(s).numel() for s in mode.shapes if s and s[-1] == V] or [0])
        assert (widest >= S * V) == whole, (options, widest)
        # the chunked op's own blocks (1024 tokens) are checked in tests/compiler
        assert ("autosp_lm.linear_cross_entropy.default" in mode.ops) != whole
    ref_loss, _ = _none(_model(layers=1)).forward_loss(batch)
    fused, _ = _none(_model(layers=1), chunked_loss=True).forward_loss(batch)
    assert fused.item() == pytest.approx(ref_loss.item(), rel=1e-6)


def test_tiled_mlp_keeps_one_chunk_of_the_intermediate():
    S, F = 512, 192
    batch = _batch(S)
    for options, limit in (({}, S * F), ({"tiled_mlp": True, "tiled_mlp_chunk_tokens": 64}, 64 * F)):
        strategy = _none(_model(layers=1), **options)
        with _Outputs() as mode:
            loss, _ = strategy.forward_loss(batch)
            loss.backward()
        widest = max(torch.Size(s).numel() for s in mode.shapes if s and s[-1] == F)
        assert widest == limit, (options, widest)
    # ALST's default chunk: the hidden size (64 tokens here)
    strategy = _none(_model(layers=1), tiled_mlp=True)
    with _Outputs() as mode:
        strategy.forward_loss(batch)[0].backward()
    assert max(torch.Size(s).numel() for s in mode.shapes if s and s[-1] == F) == 64 * F


def test_cpu_offloading_moves_each_block_input_once():
    S, H, layers = 256, 64, 3
    batch = _batch(S)
    strategy = _none(_model(layers), recompute_granularity="full", cpu_offloading=True)
    loss, _ = strategy.forward_loss(batch)
    off = strategy.recipe.offload
    # each block's input, and RoPE's cos and sin once for all blocks (shared, copied once)
    cos_sin = 2 * S * (H // 4 // 2) * 4
    assert off.host_bytes == layers * S * H * 4 + cos_sin, off.host_bytes
    assert [len(g) for g in off.groups] == [3] * layers  # x, cos, sin per checkpoint
    loss.backward()
    ref = _model(layers)
    _none(ref).forward_loss(batch)[0].backward()
    for (n, p), q in zip(strategy.model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0), n


def test_a_model_that_transforms_its_logits_cannot_use_the_chunked_loss():
    class Capped(nn.Module):  # soft-capped logits, in a style unlike ours
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(512, 32)
            self.lm_head = nn.Linear(32, 512, bias=False)

        def forward(self, input_ids, position_ids=None, labels=None):
            logits = 30.0 * torch.tanh(self.lm_head(self.emb(input_ids)) / 30.0)
            return logits

    with pytest.raises(ValueError, match="does not return its output layer's result"):
        _none(Capped(), chunked_loss=True).forward_loss(_batch(16))


def test_recipe_is_undone_and_leaves_state_dict_names():
    model = _model()
    names = list(model.state_dict())
    recipe = MemoryRecipe(model, RecipeOptions(recompute_granularity="full", tiled_mlp=True,
                                               chunked_loss=True))
    assert list(model.state_dict()) == names
    assert "forward" in model.layers[0].__dict__ and "forward" in model.lm_head.__dict__
    recipe.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("bad, msg", [
    (dict(cpu_offloading=True), "add --recompute-granularity full"),
    (dict(recompute_granularity="every"), "--recompute-granularity must be one of"),
    (dict(recompute_granularity="full", recompute_method="random"), "--recompute-method"),
    (dict(recompute_granularity="full", recompute_num_layers=0), "--recompute-num-layers"),
])
def test_bad_recipe_options_name_the_flag(bad, msg):
    with pytest.raises(ValueError, match=msg):
        RecipeOptions(**bad)


def test_compiled_offload_moves_each_block_input_once():
    """Compiled (``--compile --cpu-offloading``), the checkpoints' inputs leave the device
    through the offload ops: one host copy per block input, exact gradients, and only the
    per-checkpoint choice of the eager recipe is refused."""
    from autosp_lm.compiler import offload as offload_ops
    S, H, layers = 256, 64, 3
    batch = _batch(S)
    strategy = _none(_model(layers), compile=True, backend="aot_eager",
                     recompute_granularity="full", cpu_offloading=True)
    assert strategy.recipe.offload is None  # no saved-tensor hooks: the graph offloads
    offload_ops.reset()
    offload_ops.reset_host_peak()
    loss, _ = strategy.forward_loss(batch)
    assert offload_ops.host_peak_bytes == layers * S * H * 4, offload_ops.host_peak_bytes
    loss.backward()
    ref = _model(layers)
    _none(ref).forward_loss(batch)[0].backward()
    for (n, p), q in zip(strategy.model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), n
    with pytest.raises(ValueError, match="--cpu-offloading-num-layers"):
        check_recipe(RecipeOptions(recompute_granularity="full", cpu_offloading=True,
                                   cpu_offloading_num_layers=1), compiled=True)


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="no list of transformer blocks"):
        MemoryRecipe(nn.Sequential(nn.Linear(4, 4)), RecipeOptions(recompute_granularity="full"))
