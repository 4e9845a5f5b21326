"""Joint-graph pass for compiled ``torch.utils.checkpoint`` regions: keep a region's output when
the forward reads it after the region, as eager checkpointing does.

Under ``torch.compile`` every op of a checkpointed region is tagged for recomputation, its last
one included. PyTorch saves the boundary between two consecutive regions, but not the output of a
region that ordinary forward code reads next (the last transformer block's output read by the
final norm). The partitioner then recomputes the whole last block at the very start of the
backward, to feed the final norm's backward, and keeps every intermediate of that recompute until
the block's own backward. Eager checkpointing never does this: the norm saves its input, and the
block is recomputed when its backward starts. For a block whose MLP is tiled
(``--tiled-mlp``) the compiled recompute also holds every chunk's intermediates at once, which
undoes the tiling.

:func:`save_region_outputs` tags such outputs ``MUST_SAVE``: one ``[tokens, hidden]`` tensor
saved, what eager saves, instead of a block's intermediates live through the backward. The
values computed do not change (only what is saved vs recomputed).

Expects: an AOTAutograd joint graph whose checkpointed ops carry ``meta["recompute"]`` (and, on
the torch versions that set it, ``meta["partitioner_tag"]``). Rewrites: the recompute tag of
those outputs, nothing else (no node added or removed). Afterwards: the min-cut partitioner saves
them; the forward's values and every gradient are unchanged."""
from __future__ import annotations

from torch import fx

from ..inductor_hooks import lazy_getattr, subclass

__all__ = ["save_region_outputs"]


def _recomputed(n: fx.Node) -> bool:
    from torch.utils.checkpoint import CheckpointPolicy
    return n.meta.get("recompute") in (CheckpointPolicy.MUST_RECOMPUTE,
                                       CheckpointPolicy.PREFER_RECOMPUTE)


def save_region_outputs(joint: fx.GraphModule) -> int:
    """Tag ``MUST_SAVE`` every node of a checkpointed region that a forward node outside any
    region reads (the module docstring says what it expects and guarantees). Backward nodes:
    those AOTAutograd tags so (``partitioner_tag``), and any node that reads the tangents,
    directly or not. Returns how many nodes were tagged."""
    from torch.utils.checkpoint import CheckpointPolicy
    backward: set = set()
    for n in joint.graph.nodes:
        if n.meta.get("partitioner_tag") == "is_backward" or (
                n.op == "placeholder" and "tangents" in str(n.target)) or any(
                a in backward for a in n.all_input_nodes):
            backward.add(n)
    # where AOTAutograd tags the nodes, a reader counts only if tagged forward: a node a
    # decomposition made after the tagging carries no tags (neither region nor phase)
    tags = any("partitioner_tag" in n.meta for n in joint.graph.nodes)

    def outside_forward(u: fx.Node) -> bool:
        if u.op != "call_function" or "recompute" in u.meta or u in backward:
            return False
        return u.meta.get("partitioner_tag") == "is_forward" if tags else True

    tagged = 0
    for n in joint.graph.nodes:
        if n.op != "call_function" or not _recomputed(n) or n in backward:
            continue
        if any(outside_forward(u) for u in n.users):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            tagged += 1
    return tagged


class _JointPass:
    """Inductor's ``joint_custom_pre_pass`` running :func:`save_region_outputs` (a
    ``CustomGraphPass``: its ``uuid`` keeps Inductor's FX graph cache on)."""

    def __call__(self, graph: fx.Graph) -> None:
        save_region_outputs(graph.owning_module)

    def uuid(self):  # the whole module: a change to any helper is a new pass for the cache
        import hashlib
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()


def _joint_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass
    return type("SaveRegionOutputs", (_JointPass, CustomGraphPass), {})()


def checkpointed_backend(backend: str, offload: bool = False):
    """The ``torch.compile`` backend for a model with checkpointed regions: ``"inductor"`` with
    :func:`save_region_outputs` on the joint graph; ``"aot_eager"`` likewise (AOTAutograd's
    min-cut partitioner, no code generation); any other backend name as it is. ``offload``
    (``--cpu-offloading`` compiled): after the partition the checkpoints' saved inputs go to
    host memory and come back for the backward
    (:func:`~autosp_lm.compiler.passes.offload_activations.offload_checkpoint_inputs`)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from .offload_activations import offload_checkpoint_inputs

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        if offload:
            offload_checkpoint_inputs(fw, bw, kwargs["num_fwd_outputs"])
        return fw, bw

    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx
        patches = {"joint_custom_pre_pass": _joint_pass()}
        if offload:
            patches["custom_partitioner_fn"] = subclass(_OffloadPartitionPlain,
                                                        "_OffloadPartition")()

        def inductor(gm, example_inputs):
            return compile_fx(gm, example_inputs, config_patches=patches)
        return inductor
    if backend == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def nop(gm, example_inputs):
            return make_boxed_func(gm.forward)

        def joint_partition(joint, joint_inputs, **kwargs):
            save_region_outputs(joint)
            return partition(joint, joint_inputs, **kwargs)
        return aot_autograd(fw_compiler=nop, bw_compiler=nop,
                            partition_fn=joint_partition, keep_inference_input_mutations=True)
    if offload and isinstance(backend, str):
        raise ValueError(f"--cpu-offloading with --compile runs on the inductor or aot_eager "
                         f"backend, not {backend!r}")
    return backend  # a backend callable does its own partitioning (the planner's capture)


class _OffloadPartitionPlain:
    """Inductor's ``custom_partitioner_fn`` under the compiled ``--cpu-offloading``: the min-cut
    partition, then the checkpoints' saved inputs through the offload ops. A module-level name
    (``_OffloadPartition``, made on first use: :mod:`..inductor_hooks`) and stateless, so
    Inductor can pickle its config for the cache key (a local class logged a traceback and
    bypassed the cache); ``uuid`` None keeps AOTAutograd from reusing a partition whose offload
    ops took slots of another compile."""

    def __call__(self, gm, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from .offload_activations import offload_checkpoint_inputs
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        offload_checkpoint_inputs(fw, bw, kwargs["num_fwd_outputs"])
        return fw, bw

    def uuid(self):
        return None

    def __deepcopy__(self, memo):  # Inductor's config snapshots deep-copy their values
        return self


__getattr__ = lazy_getattr(__name__, {"_OffloadPartition": _OffloadPartitionPlain})  # the Inductor hook class by name
