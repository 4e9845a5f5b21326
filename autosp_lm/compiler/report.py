"""Pass 7 — the start-up report.

Collects what the passes did (sequence inputs, attention ops rewritten, collectives inserted with
their backward counterparts, fallbacks, loss rewrites, SAC) and renders it as text. The report is
exposed as ``run.report`` (object) / ``run.report_text()`` and printed by rank 0 at start-up.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

# forward collective -> its backward counterpart when the input requires grad
BACKWARD_OF = {"all_to_all": "all_to_all", "all_gather": "reduce_scatter",
               "all_reduce": "all_reduce", "all_reduce_loss": None, "reduce_scatter": "all_gather"}


@dataclass
class Report:
    world: int = 1
    rank: int = 0
    sequence_inputs: dict = field(default_factory=dict)
    local_length: str = ""
    attention: list = field(default_factory=list)
    collectives_fwd: Counter = field(default_factory=Counter)
    collectives_bwd: Counter = field(default_factory=Counter)
    fallbacks: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    sac: str = "off"
    backend: str = ""
    graphs: int = 0

    def collective(self, kind: str, requires_grad: bool, what: str = "") -> None:
        self.collectives_fwd[kind] += 1
        bwd = BACKWARD_OF.get(kind)
        if requires_grad and bwd:
            self.collectives_bwd[bwd] += 1

    def as_dict(self) -> dict:
        return dict(world=self.world, sequence_inputs=dict(self.sequence_inputs),
                    local_length=self.local_length, attention=list(self.attention),
                    collectives_forward=dict(self.collectives_fwd),
                    collectives_backward=dict(self.collectives_bwd),
                    fallbacks=list(self.fallbacks), loss=list(self.loss), notes=list(self.notes),
                    sac=self.sac, backend=self.backend, graphs=self.graphs)

    def text(self) -> str:
        def counts(c: Counter) -> str:
            return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none"

        lines = [f"AutoSP report (SP size {self.world}, backend {self.backend}, graphs {self.graphs})",
                 "  sequence inputs: " + (", ".join(f"{k} (dim {v})" for k, v in
                                                     self.sequence_inputs.items()) or "none"),
                 f"  local sequence length: {self.local_length}",
                 f"  attention ops rewritten ({len(self.attention)}):"]
        lines += [f"    - {a}" for a in self.attention]
        lines.append(f"  collectives per step, forward: {counts(self.collectives_fwd)}")
        lines.append(f"  collectives per step, backward: {counts(self.collectives_bwd)}")
        lines.append(f"  loss: " + ("; ".join(self.loss) or "none"))
        lines.append(f"  fallbacks ({len(self.fallbacks)}): " + ("none" if not self.fallbacks else ""))
        lines += [f"    - {f}" for f in self.fallbacks]
        for n in self.notes:
            lines.append(f"  note: {n}")
        lines.append(f"  selective activation checkpointing: {self.sac}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def merge(into: Optional[Report], new: Report) -> Report:
    """Reports of several graphs (recompiles) add up; the latest graph's counts are shown."""
    if into is None:
        new.graphs = 1
        return new
    new.graphs = into.graphs + 1
    return new
