"""``--ulysses``: the hand-written DeepSpeed-Ulysses baseline (contiguous split, all-to-all
heads <-> sequence around the model's attention; :mod:`autosp_lm.parallel.ulysses`).

With ``--ulysses-degree U`` below the sequence-parallel size ``P`` it is the hand-written 2-D
hybrid (USP-style): all-to-all over ``U`` consecutive ranks, ring attention over ``R = P / U``,
on the zigzag layout of :mod:`autosp_lm.parallel.slicing` (the layout AutoSP's 2-D plan uses).

With ``--attention-head-chunks K`` each rank's heads are attended in ``K`` chunks, one after the
other (UPipe's "untied" Ulysses, :mod:`autosp_lm.parallel.upipe`); with the ALST recipe's flags
it is UPipe's recipe (``ulysses+upipe`` in the planner and the benchmark)."""
from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

from ..parallel.heads import head_chunks, kv_replication
from ..parallel.mesh import ulysses_degree_problem, ulysses_ring_groups
from ..parallel.ring import RingAttention
from ..parallel.slicing import CONTIGUOUS, ZIGZAG, check_sequence_length
from ..parallel.ulysses import UlyssesAttention
from .memory import RecipeOptions, check_recipe
from .sliced import SlicedSPStrategy


@dataclass
class UlyssesOptions(RecipeOptions):
    compile: bool = False
    backend: str = "inductor"  # torch.compile backend with compile
    fullgraph: bool = False  # with compile: fail on any graph break
    ulysses_degree: Optional[int] = None  # None: the SP size (no ring); below it: the hybrid
    # each rank's heads in this many chunks, one after the other (UPipe); 0: one query head of
    # each rank a chunk (the most the heads allow, UPipe's choice); 1: plain Ulysses
    attention_head_chunks: int = 1

    def __post_init__(self):
        check_recipe(self, compiled=self.compile)
        if self.attention_head_chunks < 0:
            raise ValueError(f"--attention-head-chunks must be >= 0 (0: one query head of each "
                             f"rank a chunk), got {self.attention_head_chunks}")


class UlyssesStrategy(SlicedSPStrategy):
    name = "ulysses"
    Options = UlyssesOptions
    layout = CONTIGUOUS

    def __init__(self, ps, options=None, **kwargs):
        super().__init__(ps, options, **kwargs)
        U = self.options.ulysses_degree or ps.sp_size
        problem = ulysses_degree_problem(ps.sp_size, U, U, U)
        if problem:
            raise ValueError(problem)
        self.U, self.R = U, ps.sp_size // U
        if self.options.attention_head_chunks != 1 and self.R > 1:
            raise ValueError(_HYBRID_CHUNKS.format(U=U, P=ps.sp_size))
        if self.R > 1:
            self.layout, self.ulysses_degree = ZIGZAG, U

    @classmethod
    def check(cls, model_config, sp_size, seq_length, options) -> None:
        U = getattr(options, "ulysses_degree", None) or sp_size
        if sp_size > 1:
            problem = ulysses_degree_problem(sp_size, U, U, U)
            if problem:
                raise ValueError("--ulysses: " + problem)
            check_sequence_length(seq_length, sp_size, CONTIGUOUS if U == sp_size else ZIGZAG,
                                  "--ulysses")
        if U > 1 and model_config is not None:
            try:
                kv_replication(model_config.num_attention_heads, model_config.num_query_groups, U)
            except ValueError as e:
                raise ValueError(f"--ulysses: {e}; or use --ring, which has no head "
                                 f"constraint, or a smaller --ulysses-degree") from None
        chunks = getattr(options, "attention_head_chunks", 1)
        if chunks != 1:
            if U < sp_size:
                raise ValueError(_HYBRID_CHUNKS.format(U=U, P=sp_size))
            if model_config is not None:
                try:
                    head_chunks(model_config.num_attention_heads, model_config.num_query_groups,
                                sp_size, chunks)
                except ValueError as e:
                    raise ValueError(f"--ulysses: {e}") from None

    def make_attention(self):
        chunks = self.options.attention_head_chunks
        if self.ps.sp_size == 1:
            return UlyssesAttention(None, 1, head_chunks=chunks)
        if self.R == 1:
            return UlyssesAttention(self.ps.sp_group, self.ps.sp_size, head_chunks=chunks)
        mesh = ulysses_ring_groups(self.ps.sp_group, self.U)  # collective: every rank sets up
        ring = RingAttention(mesh.ring_group, self.R, zigzag=True)
        return UlyssesAttention(mesh.ulysses_group, self.U, ring=ring)

    def prepare_attention(self, model) -> None:
        super().prepare_attention(model)
        cfg = getattr(model, "config", None)
        if self.U > 1 and cfg is not None and hasattr(cfg, "num_query_groups"):
            self.attention_fn.kv_replication = kv_replication(cfg.num_attention_heads,
                                                              cfg.num_query_groups, self.U)
        if self.attention_fn.head_chunks != 1 and cfg is not None \
                and hasattr(cfg, "num_query_groups"):
            self.attention_fn.resolved_chunks = self.attention_fn.chunks_for(
                cfg.num_attention_heads, cfg.num_query_groups)

    def describe(self) -> str:
        r = getattr(self.attention_fn, "kv_replication", None)
        kv = ("kv heads split" if r in (None, 1)
              else f"kv heads replicated x{r} (so that each rank holds the ones it uses)")
        if self.R == 1:
            text = f"all-to-all heads<->sequence, contiguous {self.ps.sp_size}-way split, {kv}"
            fn = self.attention_fn
            if fn is not None and fn.head_chunks != 1:
                k = fn.resolved_chunks
                text += (f"; each rank's heads in {k} chunks, one after the other (UPipe)"
                         if k else "; each rank's heads in chunks, one after the other (UPipe)")
            return text
        return (f"2-D: all-to-all over {self.U} ranks x ring over {self.R}, zigzag split with "
                f"Ulysses degree {self.U}, {kv}")


_HYBRID_CHUNKS = ("--attention-head-chunks runs the all-to-all over the whole sequence-parallel "
                  "group, and --ulysses-degree {U} below the sequence-parallel size {P} makes "
                  "the 2-D hybrid, which has no head chunks: drop one of the two flags")
