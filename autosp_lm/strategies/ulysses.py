"""``--ulysses``: the hand-written DeepSpeed-Ulysses baseline (contiguous split, all-to-all
heads <-> sequence around the model's attention; :mod:`autosp_lm.parallel.ulysses`)."""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel.heads import kv_replication
from ..parallel.slicing import CONTIGUOUS
from ..parallel.ulysses import UlyssesAttention
from .sliced import SlicedSPStrategy


@dataclass
class UlyssesOptions:
    compile: bool = False
    backend: str = "inductor"  # torch.compile backend with compile
    fullgraph: bool = False  # with compile: fail on any graph break


class UlyssesStrategy(SlicedSPStrategy):
    name = "ulysses"
    Options = UlyssesOptions
    layout = CONTIGUOUS

    @classmethod
    def check(cls, model_config, sp_size, seq_length, options) -> None:
        super().check(model_config, sp_size, seq_length, options)
        if sp_size > 1 and model_config is not None:
            try:
                kv_replication(model_config.num_attention_heads, model_config.num_query_groups,
                               sp_size)
            except ValueError as e:
                raise ValueError(f"--ulysses: {e}; or use --ring, which has no head "
                                 f"constraint") from None

    def make_attention(self):
        return UlyssesAttention(self.ps.sp_group if self.ps.sp_size > 1 else None,
                                self.ps.sp_size)

    def describe(self) -> str:
        r = getattr(self.attention_fn, "kv_replication", None)
        kv = ("kv heads split" if r in (None, 1)
              else f"kv heads replicated x{r} (so that each rank holds the ones it uses)")
        return f"all-to-all heads<->sequence, contiguous {self.ps.sp_size}-way split, {kv}"
