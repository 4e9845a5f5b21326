"""AOTAutograd and code generation for the pass stack: :func:`compile_joint` (the joint passes,
the min-cut partitioner, then Inductor or ``aot_eager``), what runs after the partition
(:func:`after_partition`: graph FSDP's report, activation offload, the collective schedule) and
:func:`boxed_nop`, the op-by-op runner of ``aot_eager`` that the memory planner shares.

Split from :mod:`.pipeline`, which says *which* passes run; this module says *how* a graph is
compiled once the graph passes have run, and where the memory-plan choice
(:mod:`.memory_plan`) takes its turn: in the partitioner, on copies of the joint graph.
"""
from __future__ import annotations

import torch.fx as fx

from .graph import param_gathers
from .inductor_hooks import lazy_getattr, subclass
from .partition import opaque_after_rng_states
from .passes.offload_activations import offload_activations
from .passes.sac import partition_saved_bytes
from .passes.sac_graph import flat_outputs
from .schedule import collective_schedule


def run_passes(passes, gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Run the enabled ``passes`` in order; a pass returns a new module or edits ``gm`` in place."""
    for p in passes:
        if p.when(ctx.options):
            out = p.run(gm, ctx)
            if out is not None:
                gm = out
    return gm


def boxed_nop(gm: fx.GraphModule, example_inputs):
    """No-op AOTAutograd compiler with the boxed calling convention: the graph runs op by op
    (``fx.Interpreter``), takes its inputs out of the list AOTAutograd hands it (which it
    clears) and drops each value, inputs included, after its last use. Calling ``gm(*args)``
    instead kept every input alive until the graph returned: the saved activations through the
    whole backward, above what the liveness simulation (and a real aot_eager run) frees (a
    llama-tiny step measured 13% over its simulated peak with one SAC plan)."""
    def run(args):
        return fx.Interpreter(gm).boxed_run(args)
    run._boxed_call = True
    return run


def _saved_gathers(fw: fx.GraphModule, num_fwd_outputs: int) -> int:
    """How many gathered parameters the partitioned forward hands to the backward."""
    chains = set().union(*param_gathers(fw.graph).values())
    return sum(1 for o in flat_outputs(fw.graph)[num_fwd_outputs:] if o in chains)


def compile_joint(gm: fx.GraphModule, example_inputs, passes, ctx):
    """AOTAutograd + ``passes`` on the joint graph + the min-cut partitioner + code generation
    (``ctx.options.backend``). With no enabled pass this is plain ``aot_eager`` / Inductor.
    With ``ctx.chooser`` (:class:`~.memory_plan.Chooser`) the partitioner first chooses the
    options (the memory plan) on copies of the joint graph, then runs the passes with them."""
    enabled = [p for p in passes if p.when(ctx.options)]
    if ctx.options.backend == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd

        def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
            fw, bw = partition_joint(joint, joint_inputs, dict(kwargs, num_fwd_outputs=num_fwd_outputs),
                                     passes, ctx, passes_done=False)
            ctx.partitions.append((fw, bw, num_fwd_outputs))  # the memory planner reads them
            if ctx.sac_stats:
                nbytes, count = partition_saved_bytes(fw, num_fwd_outputs)
                host, _ = partition_saved_bytes(fw, num_fwd_outputs, host=True)
                ctx.sac_stats[-1].update(partition_saved_bytes=nbytes,
                                         partition_saved_tensors=count,
                                         partition_offloaded_bytes=host)
            return fw, bw

        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                            partition_fn=partition,  # the min-cut partitioner, passes or not
                            keep_inference_input_mutations=True)(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    def hook(graph: fx.Graph):
        # Inductor runs its joint-graph passes on inference graphs too: ours plan a backward;
        # with a memory-plan choice the partitioner runs them (once the options are chosen)
        if ctx.chooser is None and any(n.op == "placeholder" and n.name.startswith("tangents")
                                       for n in graph.nodes):
            graph.owning_module._num_fwd_outputs = None
            run_passes(passes, graph.owning_module, ctx)

    # SP > 1: the hook also keeps Inductor's caches off, so the partition (and the schedule check) runs
    patches = {"joint_custom_post_pass": hook} if enabled or ctx.world > 1 else {}
    if ctx.world > 1 or ctx.chooser is not None or enabled and (
            ctx.options.sac and ctx.options.offload_activations
            or ctx.options.param_sharding == "graph_fsdp"):
        # after-partition work: the collective schedule, offload, FSDP report (and the choice)
        patches["custom_partitioner_fn"] = subclass(_PartitionerPlain, "_Partitioner")(ctx, passes)
    if ctx.world > 1:  # its channels-last pass sorts symbolic strides without a shape env
        patches["layout_optimization"] = False  # and fails (Bamba: conv1d + attention)
    return compile_fx(gm, example_inputs, config_patches=patches or None)


def partition_joint(joint: fx.GraphModule, joint_inputs, kwargs: dict, passes, ctx,
                    *, passes_done: bool):
    """The joint passes (unless ``passes_done``: Inductor's hook ran them), the min-cut
    partitioner (``kwargs``: AOTAutograd's, ``num_fwd_outputs`` among them) and
    :func:`after_partition`. With ``ctx.chooser`` the memory plan is chosen instead: each
    candidate does all of that on a copy of the joint graph, and the chosen one's partition is
    returned (``ctx.options`` set to its options)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    n = kwargs["num_fwd_outputs"]
    if ctx.chooser is not None:  # the chosen candidate's trial is this partition
        chosen = ctx.chooser.choose(joint, joint_inputs, kwargs, passes, ctx)
        if chosen is not None:
            return chosen
        passes, passes_done = [p for p in passes if p.per_plan], False  # the rest have run
    if not passes_done:
        joint._num_fwd_outputs = n
        run_passes(passes, joint, ctx)
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    opaque_after_rng_states(fw, bw, n)
    after_partition(fw, bw, n, ctx)
    return fw, bw


def after_partition(fw, bw, num_fwd_outputs, ctx) -> None:
    """After the partition: what it did with graph FSDP's gathers (report), activation offload,
    and the collective schedule of the final forward and backward graphs."""
    if ctx.report.fsdp.enabled:
        ctx.report.fsdp.backward_gathers = len(param_gathers(bw.graph))
        ctx.report.fsdp.saved_gathered = _saved_gathers(fw, num_fwd_outputs)
    if ctx.options.sac and ctx.options.offload_activations:
        count, nbytes = offload_activations(fw, bw, num_fwd_outputs)
        if ctx.sac_stats:
            ctx.sac_stats[-1].update(offloaded_tensors=count, offloaded_bytes_inserted=nbytes)
    if ctx.world > 1:
        ctx.schedule = collective_schedule(fw, bw)


class _PartitionerPlain:
    """Inductor's ``custom_partitioner_fn``: :func:`partition_joint` after Inductor's joint
    passes (a ``CustomPartitionerFn`` as ``_Partitioner``, made on first use:
    :mod:`.inductor_hooks`)."""

    def __init__(self, ctx, passes: list):
        self.ctx, self.passes = ctx, passes

    def __call__(self, gm, joint_inputs, **kwargs):
        return partition_joint(gm, joint_inputs, kwargs, self.passes, self.ctx, passes_done=True)

    def uuid(self):
        return None  # never cached (the joint hook already bypasses Inductor's caches)

    def __deepcopy__(self, memo):  # Inductor's config snapshots deep-copy their values
        return self


__getattr__ = lazy_getattr(__name__, {"_Partitioner": _PartitionerPlain})  # the Inductor hook class by name
