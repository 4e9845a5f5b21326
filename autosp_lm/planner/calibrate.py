"""The memory planner calibrated against the peers' published records, on their own hardware.

Each :class:`Record` is a longest context a peer measured: the model, the GPUs (count and
memory), the host memory of a node, and the recipe, which the planner has as one of its
strategies (``planner.trace.STRATEGIES``: the peer's memory techniques on our hand-written
baselines). :func:`calibrate` searches the longest length the planner predicts for that recipe
on that hardware (:func:`~autosp_lm.planner.plan.find_max_seq_length`) and puts it beside the
published figure: a ratio near 1 says the planner models what the peer ran; a ratio away from 1
is a wrong term to find or a difference to name. What each peer runs that we do not model is
listed with the record (``differences``), from the peer's paper and code, read, never copied. A
record that needs a technique we do not have (optimizer states in host memory on one GPU) is a
named gap: its row says so instead of a ratio.

``tools/calibrate_planner.py`` runs it and writes the table (JSON and Markdown).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

GiB = 2 ** 30
#: what ``torch.cuda.get_device_properties(0).total_memory`` reports on an H100 SXM 80GB (HBM3):
#: 81,559 MiB (nvidia-smi's figure), 79.65 GiB, not 80
H100_80GB_BYTES = 85_520_809_984


@dataclass(frozen=True)
class Record:
    """A published longest context and the setup it was measured on."""

    key: str
    peer: str
    source: str  # the paper (and section/table) or code it comes from
    model: str  # our preset of the same architecture
    gpus: int
    published: int  # tokens
    published_text: str  # as the peer states it
    recipe: str  # the planner strategy that runs the peer's memory techniques
    gpu_bytes: int = H100_80GB_BYTES
    host_gib_per_node: float = 2048.0
    gpus_per_node: int = 8
    fsdp2: bool = True  # ZeRO-3 / FSDP: parameters, gradients, optimizer states sharded
    bf16: bool = True
    assumptions: tuple = ()  # what the record does not say and we assumed
    differences: tuple = ()  # what the peer runs that the planner does not model
    gap: Optional[str] = None  # the planner cannot plan this record: why
    note: str = ""


RECORDS = (
    Record(
        key="alst-8", peer="ALST", gpus=8, model="llama-3.1-8b", recipe="ulysses+alst",
        published=3_700_000, published_text="3.7M tokens (single 8 x H100 node)",
        source="arXiv 2506.13996 (Bekman et al.), Tables 1 and 3; ArcticTraining "
               "projects/sequence-parallelism run-h100-sp8-llama-8b.yml (max_length 3,800,000)",
        host_gib_per_node=1.9e12 / GiB,
        differences=(
            "ZeRO-3 with the optimizer offloaded (DeepSpeed offload_optimizer: cpu, CPU Adam): "
            "fp32 main weights and Adam states in host memory; the planner keeps them on the "
            "GPU, sharded (12 bytes a parameter / 8: 11.2 GiB a GPU for Llama-3.1-8B)",
            "Liger kernels (fused RMSNorm, RoPE, linear cross entropy): fewer saved "
            "intermediates in a block's recompute than our PyTorch model",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the planner's 4 GiB reserve "
            "stands for the allocator's slack",
            "activation checkpoint offload copies only the block's hidden states, "
            "synchronously (our compiled recipe copies what full recomputation keeps, on a "
            "side stream)",
        )),
    Record(
        key="alst-32", peer="ALST", gpus=32, model="llama-3.1-8b", recipe="ulysses+alst",
        published=15_000_000, published_text="15M tokens (4 nodes of 8 x H100)",
        source="arXiv 2506.13996, Table 4; run-h100-sp32-llama-8b.yml (max_length 15,500,000)",
        host_gib_per_node=1.9e12 / GiB,
        differences=("as alst-8",)),
    Record(
        key="upipe-8", peer="UPipe", gpus=8, model="llama-3.1-8b", recipe="ulysses+upipe",
        published=5_242_880, published_text="5M tokens = 5,242,880 (Llama-3-8B, 8 x H100)",
        source="arXiv 2602.21196 (abstract); togethercomputer/Untied-Ulysses "
               "exps/llama3_8b/run_all_8B.sh (5M = 5 x 2^20)",
        assumptions=(
            "host memory per node not published: 2 TiB assumed",
            "Llama-3-8B and Llama-3.1-8B share the architecture (32 layers, hidden 4096, "
            "32/8 heads, FFN 14336, vocabulary 128,256); the RoPE scaling does not change "
            "memory",
        ),
        differences=(
            "UPipe's block inputs are offloaded for every block but the first and the last "
            "(save_on_cpu), pinned only up to 4M tokens; the planner's recipe offloads every "
            "checkpoint's input",
            "TiledRMSNorm (the norms tiled like the MLP) and Liger's fused linear cross "
            "entropy",
            "FlashAttention-3 (the planner prices FlashAttention-2's backward workspace)",
            "the q/k/v projections and the rotary embedding inside the head chunks (each chunk "
            "projects its heads from the layer input and recomputes them in the backward); our "
            "recipe chunks the all-to-all and the attention after the model's own projections "
            "(docs/baselines.md), so q, k and v of every head exist at once for the rank's tokens",
        )),
    Record(
        key="alst-1", peer="ALST", gpus=1, model="llama-3.1-8b", recipe="ulysses+alst",
        published=500_000, published_text="500K tokens (one H100)",
        source="arXiv 2506.13996, Table 2; run-h100-sp1-llama-8b.yml (max_length 500,000)",
        host_gib_per_node=1.9e12 / GiB,
        gap="ALST keeps the parameters and the optimizer states in host memory on one GPU "
            "(ZeRO-3 offload_param + offload_optimizer: 'without parameter offload even a tiny "
            "sequence runs out of memory'); we have no parameter or optimizer offload, so the "
            "8B model state alone (16 bytes a parameter: 120 GiB) does not fit one 80 GB GPU "
            "and the planner answers 0"),
)


def record(key: str) -> Record:
    for r in RECORDS:
        if r.key == key:
            return r
    raise KeyError(f"unknown record {key!r}; choose from {', '.join(r.key for r in RECORDS)}")


@dataclass
class Row:
    record: Record
    predicted: int = 0
    seconds: float = 0.0
    confirmed: bool = False
    at_max: dict = field(default_factory=dict)
    traces: list = field(default_factory=list)
    error: Optional[str] = None

    @property
    def ratio(self) -> Optional[float]:
        return self.predicted / self.record.published if self.predicted else None

    def as_dict(self) -> dict:
        r = self.record
        return {"key": r.key, "peer": r.peer, "model": r.model, "gpus": r.gpus,
                "gpu_bytes": r.gpu_bytes, "host_gib_per_node": r.host_gib_per_node,
                "recipe": r.recipe, "published": r.published,
                "published_text": r.published_text, "source": r.source,
                "predicted": self.predicted, "ratio": self.ratio,
                "seconds": self.seconds, "confirmed": self.confirmed, "traces": self.traces,
                "gap": r.gap, "error": self.error, "assumptions": list(r.assumptions),
                "differences": list(r.differences),
                "at_max": {k: self.at_max.get(k) for k in (
                    "peak_bytes", "host_bytes", "peak_node", "breakdown",
                    "predicted_step_s", "predicted_offload_stall_s")} if self.at_max else {}}


def layout_of(rec: Record):
    from .plan import Layout
    return Layout(world=rec.gpus, fsdp2=rec.fsdp2, bf16=rec.bf16, device="cuda",
                  host_bytes=int(rec.host_gib_per_node * GiB / rec.gpus_per_node))


def calibrate_one(rec: Record, *, reserve_gb: float, log: Callable = print,
                  progress: Optional[Callable] = None) -> Row:
    """The planner's longest context for ``rec``'s recipe on ``rec``'s hardware."""
    from .plan import find_max_seq_length, trace_step
    from .trace import model_config
    row = Row(rec)
    t0 = time.time()
    layout = layout_of(rec)
    budget = rec.gpu_bytes - int(reserve_gb * GiB)
    g = 256 * rec.gpus  # first traced at the published length (the search confirms its own)
    first = max(g, rec.published // g * g)
    cfg = model_config(rec.model, {}, seq=max(rec.published * 2, 1 << 20))
    try:
        kw = {"progress": progress} if progress is not None else {}
        traced = trace_step(rec.recipe, cfg, rec.gpus, first, bf16=rec.bf16, layout=layout,
                            **kw)
        r = find_max_seq_length(rec.recipe, cfg, rec.gpus, layout, budget, bf16=rec.bf16,
                                traced=traced, **kw)
        row.predicted, row.confirmed = r["max_seq_length"], r["confirmed"]
        row.at_max, row.traces = r.get("at_max", {}), r["traces"]
    except Exception as e:  # noqa: BLE001 - one record's failure is its row, not the table's
        row.error = f"{type(e).__name__}: {e}"[:300]
    row.seconds = time.time() - t0
    log(f"{rec.key}: predicted {row.predicted:,} tokens against {rec.published:,} published"
        + (f" ({row.ratio:.3f}x)" if row.ratio else "") + f" in {row.seconds:.0f} s"
        + (f"; {row.error}" if row.error else ""))
    return row


def markdown(rows: list, env: dict) -> str:
    lines = ["# The memory planner against the peers' published records", "",
             f"Produced by `{env['command']}` ({env['date']}, torch {env['torch']}, "
             f"{env['cpu_count']} CPU cores). Each row: the peer's record, measured on its "
             "hardware, beside the planner's prediction of the same recipe on the same "
             "hardware (H100 80 GB: 79.65 GiB as torch reports it, minus the planner's reserve "
             f"of {env['reserve_gb']:g} GiB; the peer's host memory per node; bf16, parameters, "
             "gradients and optimizer states sharded over the GPUs as ZeRO-3 / FSDP2 do). "
             "*Ratio*: predicted / published (the goal: 0.9-1.1). *Time*: the planner's "
             "wall-clock seconds for the row on this machine.", "",
             "| record | model, GPUs | recipe (planner) | published | predicted | ratio | "
             "host a GPU | time |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        d = row if isinstance(row, dict) else row.as_dict()
        host = d["at_max"].get("host_bytes") if d["at_max"] else None
        pred = ("gap" if d["gap"] else "error" if d["error"] else f"{d['predicted']:,}")
        lines.append(f"| {d['key']} ({d['peer']}) | {d['model']}, {d['gpus']} x H100 | "
                     f"`{d['recipe']}` | {d['published']:,} | {pred} | "
                     + (f"{d['ratio']:.3f}" if d["ratio"] else "-") + " | "
                     + (f"{host / GiB:.0f} GiB" if host else "-")
                     + f" | {d['seconds']:.0f} s |")
    lines.append("")
    for row in rows:
        d = row if isinstance(row, dict) else row.as_dict()
        lines += [f"**{d['key']}** ({d['published_text']}; {d['source']})."]
        if d["gap"]:
            lines.append(f"* Named gap: {d['gap']}.")
        if d["error"]:
            lines.append(f"* The planner failed: `{d['error']}`.")
        for a in d["assumptions"]:
            lines.append(f"* Assumed: {a}.")
        for x in d["differences"]:
            lines.append(f"* The peer runs, the planner does not model: {x}.")
        lines.append("")
    return "\n".join(lines)


__all__ = ["H100_80GB_BYTES", "RECORDS", "Record", "Row", "calibrate_one", "layout_of",
           "markdown", "record"]
