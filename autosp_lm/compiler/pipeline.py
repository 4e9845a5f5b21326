"""The AutoSP pass stack: the literal lists of passes and the one way they are compiled.

``torch.compile(model, backend=AutoSPBackend(...), fullgraph=True)`` hands the Dynamo graph of
the whole model to :class:`AutoSPBackend`, which runs

    GRAPH_PASSES (Dynamo graph, torch-function level)
        inline einops             passes/inline_einops.py      (calls Dynamo kept opaque)
        fuse the loss head        passes/fuse_loss_head.py     (with SAC)
        find the sequence         passes/find_sequence.py
        plan U x R and layout     passes/plan.py               (Ulysses x ring degrees, groups)
        tile token-local regions  passes/tile_sequence.py      (with SAC)
        shard the sequence        passes/shard.py + rules/     (attention, loss, fallback ...)
        a model without attention (no SDPA, no hand-written attention region: planned
                                  as it is, a note in the report; refused only when a ring
                                  degree leaves its hand-written attention nothing to split)
    AOTAutograd: joint forward/backward graph (ATen level, Inductor's decompositions applied)
    JOINT_PASSES (joint graph)
        tag parameter gathers         passes/tag_param_gathers.py       (graph FSDP, SAC or not)
        keep attention outputs once   passes/attention_output_once.py   (with SAC)
        tag collectives               passes/tag_collectives.py         (with SAC)
        checkpointing policy          passes/sac.py                     (with SAC)
    min-cut partitioner (honours the recompute tags)
    PARTITION pass: offload activations  passes/offload_activations.py  (--offload-activations)
    collective schedule of the forward and backward graphs  schedule.py (SP > 1)
    -> Inductor (or aot_eager: no codegen)
    the ranks agree on the schedule (schedule.agree: a difference is an AutoSPError, never a
    hang at the first step)

``--compile --sac`` (one device) runs :data:`SINGLE_DEVICE_GRAPH_PASSES` and
:data:`SINGLE_DEVICE_JOINT_PASSES` through the same :func:`compile_joint`.

**Into Inductor, one mechanism**: the joint passes run in Inductor's ``joint_custom_post_pass``
hook (after its joint-graph passes, right before its min-cut partitioner). A plain callable in
that hook makes Inductor bypass its FX-graph and AOTAutograd caches for the graph, so the passes
always run and the report is always complete; no global config is changed outside the
compilation (``compile_fx(config_patches=...)``). On ``aot_eager`` the same passes run in the
``partition_fn`` given to AOTAutograd, which then also measures what the partition saves.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.fx as fx

from .aot import compile_joint, run_passes
from .graph import AutoSPError
from .memory_plan import Chooser, NextRound, publisher, wait_for_decision
from .passes.attention_output_once import keep_attention_output_once
from .passes.find_sequence import find_sequence
from .passes.fuse_loss_head import fuse_loss_heads
from .passes.inline_einops import inline_einops
from .passes.plan import attention_pairs, plan_sequence_parallel, seq_hint
from .passes.sac import DEFAULT_BUDGET, DEFAULT_OFFLOAD_THRESHOLD, apply_sac
from .passes.shard import shard_graph
from .passes.tag_collectives import tag_collectives
from .passes.tag_param_gathers import tag_param_gathers
from .passes.tile_sequence import tile_sequence
from .report import FSDPSummary, Report, SACSummary
from .schedule import (DEFAULT_GRACE, DEFAULT_TIMEOUT, agree, graph_signature, mark_compiling,
                       shared as schedule_shared)

BACKENDS = ("inductor", "aot_eager")


@dataclass
class AutoSPOptions:
    """What :func:`~autosp_lm.compiler.autosp_compile` (and ``--autosp``) can change."""

    sac: bool = True  # sequence-aware activation checkpointing (and the passes that go with it)
    backend: str = "inductor"  # or "aot_eager": no code generation (tests)
    sac_budget: float = DEFAULT_BUDGET  # recompute FLOPs / step FLOPs at most
    verbose: bool = True  # rank 0 prints the report when the graph is compiled
    attention_output_once: bool = True  # with SAC: attention outputs saved in one layout only
    chunked_loss: bool = True  # with SAC: fuse and chunk the loss head
    ulysses_degree: Optional[int] = None  # U of the U x R plan (None: chosen from heads, node)
    # "graph_fsdp": the model's parameters are gathered in its graph (parallel/fsdp_graph.py);
    # their gathers are re-gathered in the backward (reshard_after_forward) or kept
    param_sharding: str = "none"
    reshard_after_forward: bool = True
    # with SAC: collectives may be recomputed (re-communicated) when the cost model says so;
    # False restores the never-communicate-twice policy
    sac_recommunicate: bool = True
    sac_device: Optional[str] = None  # cost-model device: preset[,field=value...]; None: auto
    sac_memory_target: Optional[float] = None  # bytes saved for backward per rank; None: budget
    offload_activations: bool = False  # with SAC: saved activations >= threshold to host memory
    offload_threshold: int = DEFAULT_OFFLOAD_THRESHOLD
    sequence_tiling: bool = True  # with SAC: token-local regions with wide transients in chunks
    tile_chunk_tokens: Optional[int] = None  # tokens per chunk of a tiled region (None: sized)
    # each rank's attention heads in this many groups, one after the other (UPipe's head
    # chunking: one group's queries, outputs and all-to-all buffers live at a time); 1: one
    # group; 0: the most the heads allow (rules/attention.py head_groups)
    attention_head_groups: int = 1
    # the max-context mode: SAC stages are whole layers (attention recomputed, only a layer's
    # input saved, on the device or, with offload_activations, in host memory), attention in
    # the most head groups (unless attention_head_groups asks for k > 1); for the longest
    # context, at the cost of running each layer's forward again in the backward (as full
    # recomputation does)
    max_context: bool = False
    refuse_plans: tuple = ()  # "rows" (token routing), "region" (hand-written attention), "blocks"
    #                           (chunked scans), "heads" (head-parallel regions): never
    #                           started, those ops take the gather fallback (benchmarks)
    # the compile-time check that every rank runs the same collectives (schedule.py): how long
    # a rank waits for the others' schedules, and, at a recompile, for a rank that compiles
    # another graph before it is compared by the schedule it runs now
    schedule_timeout: float = DEFAULT_TIMEOUT
    schedule_grace: float = DEFAULT_GRACE
    # the memory plan (memory_plan.py): bytes a rank may use and the planner's model of a step
    # (planner/fit.py); with both, the fastest plan predicted to fit is compiled, or an
    # AutoSPError says what would fit; choose_plan=False (explicit plan flags): the options as
    # given are predicted and reported only
    memory_budget: Optional[int] = None
    memory_predictor: Optional[Callable] = None
    choose_plan: bool = True

    def __post_init__(self):
        if self.param_sharding not in ("none", "graph_fsdp"):
            raise ValueError(f"param_sharding must be 'none' or 'graph_fsdp', got "
                             f"{self.param_sharding!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"AutoSP backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.sac_budget is None:
            self.sac_budget = DEFAULT_BUDGET
        if self.sac_budget < 0:
            raise ValueError(f"SAC budget must be >= 0, got {self.sac_budget}")
        if self.sac_memory_target is not None and self.sac_memory_target < 0:
            raise ValueError(f"SAC memory target must be >= 0 bytes, got {self.sac_memory_target}")
        if self.attention_head_groups is None or self.attention_head_groups < 0:
            raise ValueError(f"attention_head_groups must be >= 0 (0: the most the heads "
                             f"allow), got {self.attention_head_groups}")
        if self.max_context:
            if not self.sac:
                raise ValueError("the max-context mode is a checkpointing plan: it needs SAC "
                                 "(drop --no-sac)")
            if self.attention_head_groups == 1:
                self.attention_head_groups = 0
        if self.memory_budget is not None and (self.memory_budget <= 0 or not self.sac):
            raise ValueError(f"a memory budget ({self.memory_budget} bytes) must be > 0 and "
                             f"needs SAC (the plans it chooses among are checkpointing plans)")
        if self.offload_activations and not self.sac:
            raise ValueError("activation offload is part of the checkpointing pass: it needs SAC "
                             "(drop --no-sac)")
        if self.sac_device is not None:
            from .cost_model import device_params
            device_params(self.sac_device)  # a bad name or field is an error here, not later


@dataclass
class PassContext:
    """What the passes of one compilation share: options, group, report, SAC statistics."""

    options: AutoSPOptions
    world: int = 1
    rank: int = 0
    group: str = ""
    report: Report = field(default_factory=Report)
    info: Any = None  # SequenceInfo, set by find_sequence
    sac_stats: list = field(default_factory=list)
    sp_group: Any = None  # the process group (the plan pass creates its subgroups)
    partitions: list = field(default_factory=list)  # (fw, bw, num_fwd_outputs) on aot_eager
    schedule: Optional[dict] = None  # the partitioned graphs' collectives (schedule.py)
    chooser: Any = None  # memory_plan.Chooser: the partitioner chooses the options first


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[fx.GraphModule, PassContext], Optional[fx.GraphModule]]
    when: Callable[[AutoSPOptions], bool] = lambda options: True
    # its work differs between the memory plans (memory_plan.py runs it once per candidate; the
    # other joint passes once, before the candidates are copied)
    per_plan: bool = False


# ============================================================================ graph passes
def _fuse_loss_head(gm, ctx):
    ctx.report.loss_heads += fuse_loss_heads(gm)


def _find_sequence(gm, ctx):
    ctx.info = find_sequence(gm, world=ctx.world, rank=ctx.rank, group=ctx.group)
    ctx.report.sequence_inputs = dict(ctx.info.inputs)
    ctx.report.local_length = f"S/{ctx.world}"


def _plan(gm, ctx):
    plan = plan_sequence_parallel(gm, ctx.info, ctx.sp_group, ctx.options.ulysses_degree)
    ctx.info.plan = plan
    hint = ctx.info.shape_env and _hint_of(ctx.info)
    ctx.report.plan = dict(ulysses_degree=plan.ulysses_degree, ring_degree=plan.ring_degree,
                           layout="contiguous" if plan.contiguous else "zigzag",
                           reason=plan.reason, traced_length=hint,
                           attention_pairs_per_rank=attention_pairs(plan, hint) if hint else None)


def _hint_of(info):
    h = seq_hint(info)
    return h if h and h > 0 else None


def _tile(gm, ctx):
    ctx.report.tiled_regions += tile_sequence(gm, ctx.info, world=ctx.world,
                                              chunk_tokens=ctx.options.tile_chunk_tokens,
                                              compiled=ctx.options.backend == "inductor")


def _shard(gm, ctx):
    return shard_graph(gm, ctx.info, ctx.report, refuse=tuple(ctx.options.refuse_plans),
                       head_groups=ctx.options.attention_head_groups)


def _without_attention(gm, ctx):
    """A model with no attention (a state-space or convolutional decoder, or per-token layers
    only) is planned as it is: the sequence stays sharded throughout, its mixing ops run by their
    rules (halo exchanges, exclusive scans) or the gather fallback, as the report lists. Refused
    only when the model's only attention is hand-written and the plan's ring degree leaves it
    nothing to split."""
    if ctx.report.attention or ctx.report.regions:
        return
    refused = ctx.report.ring_refused_regions
    if refused:  # the only attention is hand-written and the plan has a ring degree
        raise AutoSPError(
            f"AutoSP: the model's only attention is hand-written ({refused[0]})"
            f" and this plan has a ring degree (R = {ctx.report.plan.get('ring_degree')}),"
            f" which such a region does not support: nothing would be split. Fix: "
            f"--ulysses-degree equal to the sequence-parallel size (autosp_compile(..., "
            f"ulysses_degree=P)) where the heads allow it")
    ctx.report.notes.append(
        "no attention in the model (no F.scaled_dot_product_attention, no hand-written q @ k^T "
        "region): no all-to-all; the sequence stays sharded, mixed across ranks only by the "
        "rules and fallbacks listed here")


def _inline_einops(gm, ctx):
    if inline_einops(gm):
        ctx.report.notes.append("einops calls kept opaque by Dynamo were inlined into views")


GRAPH_PASSES = [
    Pass("inline einops", _inline_einops),
    Pass("fuse the loss head", _fuse_loss_head, when=lambda o: o.sac and o.chunked_loss),
    Pass("find the sequence", _find_sequence),
    Pass("plan U x R and the layout", _plan),
    Pass("tile token-local regions", _tile, when=lambda o: o.sac and o.sequence_tiling),
    Pass("shard the sequence", _shard),
    Pass("a model without attention", _without_attention),
]


# ============================================================================ joint passes
def _tag_param_gathers(joint, ctx):
    stats = tag_param_gathers(joint, ctx.options.reshard_after_forward)
    ctx.report.fsdp = FSDPSummary(enabled=True, **stats)


def _keep_output_once(joint, ctx):
    ctx.report.sac.outputs_kept_once += keep_attention_output_once(joint)


def _tag_collectives(joint, ctx):
    tag_collectives(joint)


def _joint_device(joint: fx.GraphModule):
    for n in joint.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and hasattr(v, "device"):
            return v.device
    return None


def _checkpointing_policy(joint, ctx):
    from .cost_model import auto_device
    o = ctx.options
    device = o.sac_device or auto_device(_joint_device(joint), ctx.world)
    ctx.sac_stats.append(apply_sac(joint, budget=o.sac_budget,
                                   num_fwd_outputs=getattr(joint, "_num_fwd_outputs", None),
                                   recommunicate=o.sac_recommunicate, device=device,
                                   world=ctx.world, memory_target=o.sac_memory_target,
                                   offload=o.offload_activations,
                                   offload_threshold=o.offload_threshold,
                                   stages="layers" if o.max_context else "attention"))


JOINT_PASSES = [
    Pass("tag parameter gathers", _tag_param_gathers,
         when=lambda o: o.param_sharding == "graph_fsdp"),
    Pass("keep attention outputs once", _keep_output_once,
         when=lambda o: o.sac and o.attention_output_once),
    Pass("tag collectives", _tag_collectives, when=lambda o: o.sac and not o.sac_recommunicate),
    Pass("checkpointing policy", _checkpointing_policy, when=lambda o: o.sac, per_plan=True),
]

SINGLE_DEVICE_GRAPH_PASSES = [p for p in GRAPH_PASSES if p.name == "fuse the loss head"]  # by name, not position
SINGLE_DEVICE_JOINT_PASSES = [p for p in JOINT_PASSES
                              if p.name in ("tag parameter gathers", "checkpointing policy")]


# ============================================================================ backends
def _group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, ""
    from autosp_lm.parallel.collectives import group_name
    return dist.get_world_size(group), dist.get_rank(group), group_name(group)


def _next_round(e: BaseException):
    """The :class:`~.memory_plan.NextRound` signal in ``e`` or its causes (None: an error)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, NextRound):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _sac_summary(ctx: PassContext) -> SACSummary:
    o = ctx.options
    s = SACSummary(enabled=o.sac, budget=o.sac_budget if o.sac else None,
                   outputs_kept_once=ctx.report.sac.outputs_kept_once,
                   # attention kernels: a rewrite attends in head_groups kernels
                   attentions=sum(max(1, a.head_groups) for a in ctx.report.attention))
    if ctx.sac_stats:
        st = ctx.sac_stats[-1]
        s.nodes_recomputed = st.get("nodes_recomputed")
        s.saved_bytes = st.get("saved_bytes")
        s.saved_bytes_no_recompute = st.get("saved_bytes_no_recompute")
        s.saved_bytes_per_token = st.get("saved_bytes_per_token")
        s.recompute_fraction = st.get("recompute_fraction")
        s.policy = st.get("policy")
        s.device = st.get("device")
        s.recommunicated = [r["op"] for r in st.get("recommunicated", [])]
        s.recommunicate_bytes = st.get("recommunicate_bytes")
        s.offloaded_bytes = st.get("offloaded_bytes")
        s.memory_target = st.get("memory_target")
        s.target_met = st.get("target_met")
    return s


class AutoSPBackend:
    """The ``torch.compile`` backend of AutoSP over ``group`` (default: the world)."""

    def __init__(self, group=None, options: Optional[AutoSPOptions] = None):
        self.group = group
        self.options = options or AutoSPOptions()
        self.report: Optional[Report] = None
        self.sac_stats: list = []
        self.graph_breaks: list = []  # first-call graph breaks handled (first_call.py)
        #: set to a list to record the partitioned (fw, bw, num_fwd_outputs) of every graph it
        #: compiles on aot_eager (the memory planner does); None: nothing is kept (training)
        self.partitions: Optional[list] = None
        self.compiles = 0
        self.__name__ = "autosp"

    def __call__(self, gm: fx.GraphModule, example_inputs):
        world, rank, gname = _group_info(self.group)
        signature = graph_signature(gm, example_inputs) if world > 1 else ""
        key = mark_compiling(self.group, signature)  # names its schedule in the group's store
        chooser, options, decision = self._memory_plan(world, rank, key)
        if chooser is None:
            return self._compile(gm, example_inputs, options, None, decision, key)
        original = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        while True:  # a round that fits nothing compiles the graph again for the next round
            try:
                return self._compile(gm, example_inputs, chooser.round_options(options), chooser,
                                     None, key)
            except Exception as e:  # noqa: BLE001 - Inductor may wrap the partitioner's signal
                nxt = _next_round(e)
                if nxt is None:
                    raise
                chooser.round_index = nxt.round_index + 1
                gm = fx.GraphModule(original, copy.deepcopy(original.graph))

    def _memory_plan(self, world: int, rank: int, key: str):
        """(chooser or None, options, a decision received from the first rank or None)."""
        o = self.options
        if o.memory_budget is None or o.memory_predictor is None or not o.sac:
            return None, o, None
        shared = world > 1 and schedule_shared(self.group)
        if shared and rank != 0:  # the first rank of the group chooses: take its choice
            decision = wait_for_decision(self.group, key, o.schedule_timeout)
            return None, dataclasses.replace(o, **decision["changes"]), decision
        return Chooser(budget=int(o.memory_budget), predictor=o.memory_predictor,
                       fixed=not o.choose_plan,
                       publish=publisher(self.group, key) if shared else (lambda d: None)), o, None

    def _compile(self, gm, example_inputs, options, chooser, decision, key):
        world, rank, gname = _group_info(self.group)
        ctx = PassContext(options, world=world, rank=rank, group=gname,
                          report=Report(world=world, rank=rank, backend=options.backend),
                          sp_group=self.group, chooser=chooser)
        ctx.report.graph_breaks = list(self.graph_breaks)
        gm = run_passes(GRAPH_PASSES, gm, ctx)
        ctx.report.graphs = (self.report.graphs if self.report is not None else 0) + 1
        ctx.partitions = self.partitions if self.partitions is not None else []
        compiled = compile_joint(gm, example_inputs, JOINT_PASSES, ctx)
        self.report, self.sac_stats = ctx.report, ctx.sac_stats
        if chooser is not None and chooser.decision is None:  # no backward: nothing to choose
            chooser.publish({"changes": {}, "inference": True})
        ctx.report.memory_plan = dict((chooser.decision if chooser is not None else decision)
                                      or {})
        ctx.report.memory_plan.pop("inference", None)
        self._agree(ctx, key)
        ctx.report.sac = _sac_summary(ctx)
        # each attention whose output is kept once adds one small all-to-all to the backward
        ctx.report.collectives_bwd["all_to_all"] += ctx.report.sac.outputs_kept_once
        for op in ctx.report.sac.recommunicated:  # forward collectives run again in the backward
            ctx.report.collectives_bwd[op] += 1
        if self.options.verbose and (not dist.is_initialized() or dist.get_rank() == 0):
            print(ctx.report.text(), flush=True)
        return compiled

    def _agree(self, ctx: PassContext, key: str) -> None:
        """Every rank runs the same collectives, or an AutoSPError now (schedule.py)."""
        first, self.compiles = self.compiles == 0, self.compiles + 1
        if ctx.world <= 1:
            return
        if ctx.schedule is None:  # no backward: an inference graph (not partitioned)
            ctx.report.notes.append("collective schedule not checked: an inference graph")
            return
        ctx.report.schedule = agree(ctx.schedule, self.group, key=key, first=first,
                                    timeout=self.options.schedule_timeout,
                                    grace=self.options.schedule_grace)


class SACBackend:
    """``--compile --sac``: one device, the loss-head fusion and the checkpointing policy."""

    def __init__(self, options: Optional[AutoSPOptions] = None):
        self.options = options or AutoSPOptions()
        self.stats: list = []
        self.fused_losses: list = []
        self.__name__ = "sac"

    def __call__(self, gm: fx.GraphModule, example_inputs):
        ctx = PassContext(self.options, sac_stats=self.stats)
        gm = run_passes(SINGLE_DEVICE_GRAPH_PASSES, gm, ctx)
        self.fused_losses += ctx.report.loss_heads
        return compile_joint(gm, example_inputs, SINGLE_DEVICE_JOINT_PASSES, ctx)


