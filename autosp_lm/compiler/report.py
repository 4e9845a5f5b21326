"""The start-up report: what the passes did, as structured records and as text.

Every pass writes into one :class:`Report`: the sequence inputs it found, each attention op it
rewrote (:class:`AttentionRewrite`), the collectives per step with their backward counterparts,
the loss rewrites (:class:`LossRewrite`), the fallbacks (:class:`Fallback`, each with its source
line), the fused loss heads, and what the checkpointing pass decided (:class:`SACSummary`).
``run.report`` is the object (tests and tools read its fields); ``run.report.text()`` is what rank
0 prints at start-up.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch.fx as fx

from .graph import describe, op_name, source_location

# forward collective -> its backward counterpart when the input requires grad
BACKWARD_OF = {"all_to_all": "all_to_all", "all_gather": "reduce_scatter",
               "all_reduce_sum": "all_reduce_sum", "all_reduce_loss": None,
               "reduce_scatter": "all_gather", "ring_attention": "ring_attention_backward",
               "seq_window": "seq_window_backward",
               "exclusive_scan": "exclusive_scan_backward"}

#: the classes of model code the per-class summary groups rewrites and fallbacks into
CLASSES = ("attention", "attention region", "short-range mixing", "slices", "scans",
           "token routing", "loss", "graph breaks", "other")
_CLASS_OF_OP = {
    **dict.fromkeys(("cat", "concat", "concatenate", "pad", "roll", "conv1d", "conv2d", "stack",
                     "flip", "unfold"), "short-range mixing"),
    **dict.fromkeys(("getitem", "narrow", "select", "index_select", "slice", "split", "chunk",
                     "unbind", "tensor_split"), "slices"),
    **dict.fromkeys(("matmul", "mm", "bmm", "einsum", "baddbmm", "softmax", "log_softmax",
                     "masked_fill", "tril", "triu", "tanh"), "attention region"),
    **dict.fromkeys(("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"), "scans"),
    **dict.fromkeys(("sort", "argsort", "topk", "histc", "bincount", "scatter_add", "scatter",
                     "scatter_add_", "index_add", "index_add_", "gather", "index_put",
                     "setitem", "repeat_interleave", "one_hot", "grouped_mm", "_grouped_mm",
                     "scatter_reduce"), "token routing"),
    **dict.fromkeys(("scaled_dot_product_attention",), "attention"),
    **dict.fromkeys(("cross_entropy", "nll_loss", "linear_cross_entropy", "sum", "mean"), "loss"),
}


def op_class(op: str) -> str:
    """The model-code class an op belongs to in the per-class summary."""
    return _CLASS_OF_OP.get(op, "other")


@dataclass
class NodeRecord:
    node: str  # graph node name
    op: str  # short op name
    location: str  # file:line of the user's code ('' if unknown)
    description: str  # node (op) at file:line: code

    @classmethod
    def of(klass, n: fx.Node, **fields):
        return klass(node=n.name, op=op_name(n), location=source_location(n),
                     description=describe(n), **fields)


@dataclass
class AttentionRewrite(NodeRecord):
    heads: int = 0
    heads_per_rank: int = 0
    kv_heads: int = 0
    kv_replication: int = 1
    kv_plan: str = ""
    masking: str = "causal"  # causal | mask | full
    head_groups: int = 1  # the rank's heads attended in this many groups, one after the other

    def text(self) -> str:
        groups = (f", in {self.head_groups} groups of {self.heads_per_rank // self.head_groups}"
                  if self.head_groups > 1 else "")
        return (f"{self.description}: {self.heads} heads -> {self.heads_per_rank} per rank"
                f"{groups}, {self.kv_plan}, {self.masking}")


@dataclass
class LossRewrite(NodeRecord):
    how: str = ""

    def text(self) -> str:
        return f"{self.description}: {self.how}"


@dataclass
class Fallback(NodeRecord):
    reason: str = ""
    cls: str = ""  # the class of CLASSES it belongs to

    def text(self) -> str:
        return f"{self.description}: {self.reason}"


@dataclass
class Rewrite(NodeRecord):
    """One op (or region) a rule rewrote without gathering the sequence."""

    cls: str = ""  # one of CLASSES
    how: str = ""

    def text(self) -> str:
        return f"{self.description}: {self.how}"


@dataclass
class RegionRewrite(NodeRecord):
    """A hand-written attention region: from its entry (the scores op) to where its values
    leave it; Ulysses all-to-alls around it."""

    split: int = 0  # size of the split (heads or batch x heads) dimension
    per_rank: int = 0
    ops: list = field(default_factory=list)  # the ops inside the region, in order
    entry: str = ""  # a head-parallel region: why its entry op had no sharding rule

    def text(self) -> str:
        inside = ", ".join(self.ops) if self.ops else "-"
        why = f" (instead of a gather: {self.entry})" if self.entry else ""
        return (f"{self.description}: {self.split} heads -> {self.per_rank} per rank, whole "
                f"sequence inside{why}; ops: {inside}")


@dataclass
class SACSummary:
    enabled: bool = False
    budget: Optional[float] = None
    nodes_recomputed: Optional[int] = None
    saved_bytes: Optional[int] = None
    saved_bytes_no_recompute: Optional[int] = None
    saved_bytes_per_token: Optional[float] = None
    recompute_fraction: Optional[float] = None
    outputs_kept_once: int = 0
    attentions: int = 0  # attention kernels (a rewrite in head groups runs one per group)
    policy: Optional[str] = None  # recommunicate | never-recommunicate
    device: Optional[str] = None  # cost-model device preset
    recommunicated: list = field(default_factory=list)  # forward collectives run again (op names)
    recommunicate_bytes: Optional[float] = None
    offloaded_bytes: Optional[int] = None
    memory_target: Optional[float] = None
    target_met: Optional[bool] = None

    def text(self) -> str:
        if not self.enabled:
            return "off"
        out = f"on (budget {self.budget}" + (f", device {self.device}" if self.device else "")
        if self.memory_target is not None:
            out += (f", memory target {self.memory_target / 2**20:.2f} MiB "
                    + ("met" if self.target_met else "NOT met"))
        out += ")"
        if self.nodes_recomputed is not None:
            out += f": {self.nodes_recomputed} forward nodes recomputed"
        if self.saved_bytes is not None and self.saved_bytes_no_recompute is not None:
            out += (f", saved-for-backward {self.saved_bytes / 2**20:.2f} MiB of "
                    f"{self.saved_bytes_no_recompute / 2**20:.2f} MiB without recompute (at the "
                    f"traced length)")
        if self.offloaded_bytes:
            out += f", {self.offloaded_bytes / 2**20:.2f} MiB offloaded to host memory"
        if self.policy == "never-recommunicate":
            out += "; collectives never re-communicated"
        elif self.recommunicated:
            kinds = Counter(self.recommunicated)
            out += ("; re-communicated in the backward: "
                    + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
                    + f" ({(self.recommunicate_bytes or 0) / 2**20:.2f} MiB on the wire)")

        if self.outputs_kept_once:
            out += (f"; attention output saved once, in the sequence layout, for "
                    f"{self.outputs_kept_once} of {self.attentions} attention kernels (the "
                    f"backward gets rowsum(dO*O) by one [B, H, S/P, 1] all_to_all each)")
        return out


@dataclass
class FSDPSummary:
    """Graph FSDP's parameter gathers in the compiled step (:mod:`.passes.tag_param_gathers`)."""

    enabled: bool = False
    gathers: int = 0  # parameter all-gathers in the forward
    gather_bytes: int = 0
    reduce_scatters: int = 0  # gradient reduce-scatters in the backward
    reduce_scatter_bytes: int = 0
    reshard_after_forward: bool = True
    backward_gathers: Optional[int] = None  # measured on the partition
    saved_gathered: Optional[int] = None  # gathered parameters saved for the backward (same)

    def text(self) -> str:
        if not self.enabled:
            return "off"
        mib = 2 ** 20
        out = (f"{self.gathers} parameter all-gathers in the forward "
               f"({self.gather_bytes / mib:.2f} MiB), {self.reduce_scatters} gradient "
               f"reduce-scatters in the backward ({self.reduce_scatter_bytes / mib:.2f} MiB); ")
        if self.reshard_after_forward:
            out += ("resharded after forward: the backward re-gathers the parameters it needs "
                    "(FSDP's reshard-after-forward: all-gather traffic twice per step)")
            if self.backward_gathers is not None:
                out += f", {self.backward_gathers} re-gathers in the backward"
        else:
            out += "gathered parameters kept from the forward to the backward (gathered once)"
        if self.saved_gathered is not None:
            out += f", {self.saved_gathered} gathered parameters saved for the backward"
        return out


@dataclass
class Report:
    world: int = 1
    rank: int = 0
    backend: str = ""
    sequence_inputs: dict = field(default_factory=dict)
    local_length: str = ""
    attention: list = field(default_factory=list)  # AttentionRewrite
    collectives_fwd: Counter = field(default_factory=Counter)
    collectives_bwd: Counter = field(default_factory=Counter)
    fallbacks: list = field(default_factory=list)  # Fallback
    loss: list = field(default_factory=list)  # LossRewrite
    loss_heads: list = field(default_factory=list)  # descriptions of fused loss heads
    tiled_regions: list = field(default_factory=list)  # token-local regions run in chunks
    notes: list = field(default_factory=list)
    sac: SACSummary = field(default_factory=SACSummary)
    plan: dict = field(default_factory=dict)  # the U x R plan (passes/plan.py)
    fsdp: FSDPSummary = field(default_factory=FSDPSummary)
    graphs: int = 0
    rewrites: list = field(default_factory=list)  # Rewrite (shifts, scans, routing, slices ...)
    regions: list = field(default_factory=list)  # RegionRewrite (hand-written attention)
    ring_refused_regions: list = field(default_factory=list)  # region entries a ring plan refused
    graph_breaks: list = field(default_factory=list)  # first-call breaks handled (text)
    schedule: Any = None  # schedule.Agreement: the ranks run the same collectives (SP > 1)
    length_multiple: int = 1  # the sequence length must be a multiple of it (blocks: P x block)
    memory_plan: dict = field(default_factory=dict)  # the plan chosen to fit the budget (memory_plan.py)

    _SHARD_FIELDS = ("attention", "collectives_fwd", "collectives_bwd", "fallbacks", "loss",
                     "notes", "rewrites", "regions", "length_multiple")

    def snapshot(self) -> dict:
        """The fields the sharding pass fills (to start it over: :meth:`restore`)."""
        return {k: copy.deepcopy(getattr(self, k)) for k in self._SHARD_FIELDS}

    def restore(self, snap: dict) -> None:
        for k, v in snap.items():
            setattr(self, k, copy.deepcopy(v))

    # -- what the passes call --------------------------------------------------------------
    def collective(self, kind: str, requires_grad: bool) -> None:
        self.collectives_fwd[kind] += 1
        bwd = BACKWARD_OF.get(kind)
        if requires_grad and bwd:
            self.collectives_bwd[bwd] += 1

    def attention_rewrite(self, n: fx.Node, **fields) -> None:
        self.attention.append(AttentionRewrite.of(n, **fields))

    def loss_rewrite(self, n: fx.Node, how: str) -> None:
        self.loss.append(LossRewrite.of(n, how=how))

    def fallback(self, n: fx.Node, reason: str) -> None:
        self.fallbacks.append(Fallback.of(n, reason=reason, cls=op_class(op_name(n))))

    def rewrite(self, cls: str, n: fx.Node, how: str) -> None:
        assert cls in CLASSES, cls
        self.rewrites.append(Rewrite.of(n, cls=cls, how=how))

    def region(self, n: fx.Node, **fields) -> RegionRewrite:
        rec = RegionRewrite.of(n, **fields)
        self.regions.append(rec)
        return rec

    def by_class(self) -> dict:
        """Per class of :data:`CLASSES`: what was rewritten and what stayed a fallback (node
        descriptions); only classes with an entry."""
        out = {c: {"rewritten": [], "fallbacks": []} for c in CLASSES}
        for a in self.attention:
            out["attention"]["rewritten"].append(a.description)
        for r in self.regions:
            out[op_class(r.op) if r.entry else "attention region"]["rewritten"].append(
                r.description)
        for x in self.loss:
            out["loss"]["rewritten"].append(x.description)
        for w in self.rewrites:
            out[w.cls]["rewritten"].append(w.description)
        for b in self.graph_breaks:
            out["graph breaks"]["rewritten"].append(b)
        for f in self.fallbacks:
            out[f.cls or "other"]["fallbacks"].append(f.description)
        return {c: v for c, v in out.items() if v["rewritten"] or v["fallbacks"]}

    # -- reading ------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        return dict(world=self.world, backend=self.backend,
                    sequence_inputs=dict(self.sequence_inputs), local_length=self.local_length,
                    attention=[asdict(a) for a in self.attention],
                    collectives_forward=dict(self.collectives_fwd),
                    collectives_backward=dict(self.collectives_bwd),
                    fallbacks=[asdict(f) for f in self.fallbacks],
                    loss=[asdict(x) for x in self.loss], loss_heads=list(self.loss_heads),
                    tiled_regions=list(self.tiled_regions),
                    notes=list(self.notes), sac=asdict(self.sac), plan=dict(self.plan),
                    fsdp=asdict(self.fsdp), graphs=self.graphs,
                    rewrites=[asdict(w) for w in self.rewrites],
                    regions=[asdict(r) for r in self.regions],
                    graph_breaks=list(self.graph_breaks), by_class=self.by_class(),
                    length_multiple=self.length_multiple, memory_plan=dict(self.memory_plan),
                    schedule=asdict(self.schedule) if self.schedule is not None else None)

    def text(self) -> str:
        def counts(c: Counter) -> str:
            return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none"

        lines = [f"AutoSP report (SP size {self.world}, backend {self.backend}, "
                 f"graphs {self.graphs})",
                 "  sequence inputs: " + (", ".join(f"{k} (dim {v})" for k, v in
                                                     self.sequence_inputs.items()) or "none"),
                 f"  local sequence length: {self.local_length}" + (
                     f" (the sequence length must be a multiple of {self.length_multiple}: "
                     f"a chunked scan's blocks, or a padding to a multiple)" if self.length_multiple > 1
                     else ""),
                 "  plan: " + self._plan_text(),
                 f"  attention ops rewritten ({len(self.attention)}):"]
        lines += [f"    - {a.text()}" for a in self.attention]
        for title, regions in (("hand-written attention regions",
                                [r for r in self.regions if not r.entry]),
                               ("head-parallel regions (ops without a sharding rule, run for "
                                "1/P of a dimension they treat independently)",
                                [r for r in self.regions if r.entry])):
            if regions:
                lines.append(f"  {title} ({len(regions)}):")
                lines += [f"    - {r.text()}" for r in regions]
        if self.rewrites:
            lines.append(f"  other sequence-mixing ops rewritten ({len(self.rewrites)}):")
            lines += [f"    - [{w.cls}] {w.text()}" for w in self.rewrites]
        lines.append(f"  collectives per step, forward: {counts(self.collectives_fwd)}")
        lines.append(f"  collectives per step, backward: {counts(self.collectives_bwd)}")
        lines.append("  loss: " + ("; ".join(x.text() for x in self.loss) or "none"))
        lines += [f"  loss head {h}" for h in self.loss_heads]
        lines += [f"  sequence-tiled region {r}" for r in self.tiled_regions]
        lines.append(f"  fallbacks ({len(self.fallbacks)}): "
                     + ("none" if not self.fallbacks else ""))
        lines += [f"    - {f.text()}" for f in self.fallbacks]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  first-call graph break: {b}" for b in self.graph_breaks]
        summary = self.by_class()
        if summary:
            lines.append("  per class (rewritten / fallbacks):")
            lines += [f"    {c}: {len(v['rewritten'])} / {len(v['fallbacks'])}"
                      for c, v in summary.items()]
        lines.append(f"  selective activation checkpointing: {self.sac.text()}")
        if self.memory_plan:
            lines.append("  memory plan: " + memory_plan_text(self.memory_plan))
        if self.fsdp.enabled:
            lines.append(f"  fully sharded parameters (graph FSDP): {self.fsdp.text()}")
        if self.schedule is not None:
            lines.append("  collective schedule: " + self._schedule_text())
        return "\n".join(lines)

    def _schedule_text(self) -> str:
        a = self.schedule
        text = (f"{a.forward} forward + {a.backward} backward collectives, hash {a.hash}, ")
        if a.how == "all ranks":
            return text + f"the same on all {a.ranks} ranks (checked at compile time)"
        if a.how == "alone":
            return text + (f"recompiled on this rank alone; the same order of collectives as "
                           f"ranks {a.alone_with} run now (checked at compile time)")
        return text + "not compared (no other rank to meet: a simulated world, or no store)"

    def _plan_text(self) -> str:
        p = self.plan
        if not p:
            return "Ulysses over the whole group"
        text = (f"Ulysses degree {p['ulysses_degree']} x ring degree {p['ring_degree']}, "
                f"{p['layout']} layout ({p['reason']})")
        pairs = p.get("attention_pairs_per_rank")
        if pairs and p["ring_degree"] > 1:
            text += (f"; causal attention pairs per rank at the traced length "
                     f"{p['traced_length']}: max/min {max(pairs) / max(min(pairs), 1):.3f}")
        return text

    def __str__(self) -> str:
        return self.text()


def memory_plan_text(decision: dict) -> str:
    """The compile report's memory-plan line (:mod:`.memory_plan`): ``NAME (flags), predicted
    peak X MiB of budget Y MiB, predicted step Z s; next fastest: NAME (peak ...)``."""
    d, mib = decision, 2 ** 20
    if d.get("peak") is None:
        return f"{d['name']}: not predicted ({d.get('why_not', '')}); compiled as given"
    text = (f"{d['name']} ({d['flags']}), predicted peak {d['peak'] / mib:.0f} MiB of budget "
            f"{d['budget'] / mib:.0f} MiB, predicted step {d['step_s']:.3g} s")
    if d.get("fixed"):
        text += "; explicit flags, not chosen" + ("" if d["fits"] else
                                                  " (over the budget: it may run out of memory)")
    nxt = d.get("next")
    if nxt:
        text += (f"; next fastest: {nxt['name']} (peak {nxt['peak'] / mib:.0f} MiB, step "
                 f"{nxt['step_s']:.3g} s{'' if nxt['fits'] else ', does not fit'})")
    elif not d.get("fixed"):
        text += "; no other plan predicted"
    return text + f"; chosen in {d.get('seconds', 0):.2f} s"
