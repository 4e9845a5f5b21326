"""``--ring``: the hand-written ring-attention baseline (zigzag split, key/value blocks passed
around the ring with exact log-sum-exp merging; :mod:`autosp_lm.parallel.ring`)."""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel.ring import KERNELS, RingAttention, selected_kernels
from ..parallel.slicing import ZIGZAG, attention_pairs_per_rank
from .memory import RecipeOptions, check_recipe
from .sliced import SlicedSPStrategy


@dataclass
class RingOptions(RecipeOptions):
    compile: bool = False
    backend: str = "inductor"  # torch.compile backend with compile
    fullgraph: bool = False
    kernel: str = "auto"  # block kernel, one of parallel.ring.KERNELS

    def __post_init__(self):
        check_recipe(self, compiled=self.compile)
        if self.kernel not in KERNELS:
            raise ValueError(f"--ring: unknown kernel {self.kernel!r}; choose one of {KERNELS}")


class RingStrategy(SlicedSPStrategy):
    name = "ring"
    Options = RingOptions
    layout = ZIGZAG

    @classmethod
    def check(cls, model_config, sp_size, seq_length, options) -> None:
        super().check(model_config, sp_size, seq_length, options)
        if model_config is not None and getattr(model_config, "dropout", 0.0):
            raise ValueError(f"--ring: attention dropout ({model_config.dropout}) is not "
                             f"supported by the ring attention baseline; train with "
                             f"--hidden-dropout 0")

    def forward_loss(self, batch: dict):
        docs = batch.get("document_ids")
        if docs is not None and getattr(self, "document_work", None) is None:
            self.document_work = attention_pairs_per_rank(docs, self.ps.sp_size, self.layout)
        return super().forward_loss(batch)

    def make_attention(self):
        return RingAttention(self.ps.sp_group if self.ps.sp_size > 1 else None, self.ps.sp_size,
                             zigzag=self.layout == ZIGZAG, kernel=self.options.kernel)

    def describe(self) -> str:
        chosen = selected_kernels()
        k = self.options.kernel
        kern = k if k != "auto" else (
            "auto (" + ", ".join(f"{a}: {b}" for a, b in chosen.items()) + ")" if chosen
            else "auto (chosen at the first step)")
        text = (f"ring of {self.ps.sp_size} ranks with point-to-point kv exchange overlapped "
                f"with compute, exact log-sum-exp merge, block kernel {kern}")
        work = getattr(self, "document_work", None)
        if work:
            text += (f"; document masks: blocks that see nothing are skipped (their kv still "
                     f"travels the ring); the zigzag split balances causal attention, not "
                     f"documents: attention pairs per rank in the first batch "
                     f"{', '.join(map(str, work))} (max/min {max(work) / max(min(work), 1):.2f})")
        return text
