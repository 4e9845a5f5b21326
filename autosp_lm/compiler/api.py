"""The public entry points: ``autosp_compile`` (sequence parallel) and ``sac_compile`` (one device).

An unchanged single-device model goes in; a callable with the model's signature comes out. The
pass stack itself is listed in :mod:`autosp_lm.compiler.pipeline`.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from autosp_lm.parallel import slicing

from .first_call import FIX, break_site, eager_first_call, hook_install_site
from .graph import AutoSPError
from .pipeline import AutoSPBackend, AutoSPOptions, SACBackend
from .passes.sac import DEFAULT_BUDGET

SEQUENCE_ARGUMENTS = ("input_ids", "labels", "position_ids", "attention_mask", "document_ids")
_ATTR = "_autosp_sequence_dim"


def mark_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Mark ``tensor`` as a sequence input whose sequence lies on ``dim``; returns ``tensor``."""
    setattr(tensor, _ATTR, dim % tensor.dim())
    return tensor


def _sequence_dims(name: str, value) -> Optional[list]:
    if not isinstance(value, torch.Tensor):
        return None
    dim = getattr(value, _ATTR, None)
    if dim is not None:
        return [dim]
    if name in SEQUENCE_ARGUMENTS and value.dim() >= 2:
        if name == "attention_mask" and value.dim() >= 3:
            return [value.dim() - 2, value.dim() - 1]
        return [1]
    return None


def check_sequence_length(seq_len: int, sp_size: int, what: str = "AutoSP",
                          ring: bool = False) -> None:
    """The divisibility rule of the split (one rule for every strategy:
    :func:`autosp_lm.parallel.slicing.check_sequence_length`; ``ring``: the zigzag layout of a
    plan with a ring), as an AutoSPError."""
    try:
        slicing.check_sequence_length(seq_len, sp_size,
                                      slicing.ZIGZAG if ring else slicing.CONTIGUOUS, what)
    except ValueError as e:
        raise AutoSPError(str(e)) from None


class AutoSPRunner:
    """What :func:`autosp_compile` returns: call it like the model."""

    def __init__(self, model: torch.nn.Module, sp_group=None,
                 options: Optional[AutoSPOptions] = None):
        self.model = model
        self.sp_group = sp_group
        self.options = options or AutoSPOptions()
        self.backend = AutoSPBackend(sp_group, self.options)
        self.compiled = torch.compile(model, backend=self.backend, fullgraph=True)
        self._signature = inspect.signature(model.forward)

    @property
    def world(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.sp_group)
        return 1

    @property
    def report(self):
        """The pass report of the last compiled graph (None before the first call)."""
        return self.backend.report

    @property
    def sac_stats(self) -> list:
        """The SAC policy's statistics of the last compiled graph."""
        return self.backend.sac_stats

    def local_positions(self, seq_len: int) -> torch.Tensor:
        """The global positions of this rank's shard of outputs that carry the sequence (after
        the first call), for a sequence of ``seq_len``."""
        from autosp_lm.parallel.slicing import CONTIGUOUS, ZIGZAG, shard_positions
        plan = self.report.plan if self.report is not None else {}
        rank = dist.get_rank(self.sp_group) if dist.is_initialized() else 0
        layout = ZIGZAG if plan.get("layout") == "zigzag" else CONTIGUOUS
        return shard_positions(seq_len, self.world, rank, layout,
                               ulysses_degree=plan.get("ulysses_degree", self.world))

    def report_text(self) -> str:
        return self.report.text() if self.report is not None else "AutoSP: not compiled yet"

    def _mark(self, args, kwargs) -> dict:
        """Mark the sequence dims dynamic (all others static); -> {argument name: dims}."""
        try:
            bound = self._signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = dict(kwargs)
        items = []
        for name, value in bound.items():
            if isinstance(value, dict):  # **kwargs
                items += list(value.items())
            else:
                items.append((name, value))
        lengths, found = [], {}
        for name, value in items:
            dims = _sequence_dims(name, value)
            if not dims:
                continue
            found[name] = dims
            for d in dims:
                lengths.append((name, value.size(d)))
                torch._dynamo.mark_dynamic(value, d)
            for d in range(value.dim()):
                if d not in dims:  # one dim at a time: list arguments are newer than torch 2.11
                    torch._dynamo.mark_static(value, d)
        if not lengths:
            raise AutoSPError("AutoSP: no sequence input in this call; pass input_ids/labels/"
                              "position_ids/attention_mask by name or use mark_sequence(t, dim)")
        sizes = {s for _, s in lengths}
        if len(sizes) != 1:
            raise AutoSPError("AutoSP: sequence inputs have different lengths: "
                              + ", ".join(f"{n}={s}" for n, s in lengths))
        plan = self.report.plan if self.report is not None else {}
        length = sizes.pop()
        check_sequence_length(length, self.world, ring=plan.get("ring_degree", 1) > 1)
        multiple = self.report.length_multiple if self.report is not None else 1
        if length % multiple:
            lower, upper = (length // multiple) * multiple, (length // multiple + 1) * multiple
            raise AutoSPError(
                f"AutoSP: sequence length {length} is not a multiple of {multiple}, which the "
                f"compiled plan needs: the model cuts the sequence into blocks (a chunked scan) "
                f"that each of the {self.world} ranks must hold whole, or pads it to a multiple "
                f"(planned as no padding); use --seq-length "
                f"{upper if lower == 0 else f'{lower} or {upper}'}")
        return found

    def __call__(self, *args, **kwargs):
        seq_dims = self._mark(args, kwargs)
        try:
            return self._call(args, kwargs, seq_dims)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, AutoSPError):
                raise inner from None
            raise
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            site = hook_install_site(e)
            if site is not None:
                again = " again after one eager call" if self.backend.graph_breaks else ""
                raise AutoSPError(
                    f"AutoSP needs the whole model as one graph but the model installs hooks "
                    f"on a traced call{again} ({site}), a graph break. Fix: {FIX}") from e
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            again = " (also after one eager call)" if self.backend.graph_breaks else ""
            raise AutoSPError(
                "AutoSP needs the whole model as one graph (fullgraph=True) but Dynamo could not "
                f"trace it without a graph break{again} at {break_site(e)}: {first}; "
                "remove the break (data-dependent Python control flow, .item()/.tolist(), "
                "unsupported calls) from the model's forward.") from e


    def _call(self, args, kwargs, seq_dims):
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            if self.backend.graph_breaks or self.backend.compiles:  # not the first call
                raise
            hook = hook_install_site(e)
            site = hook or break_site(e)
        # a break on the first call (hooks installed then, state set up once): one safe eager
        # call gets past it, then trace again; a break that remains is reported by __call__
        bound = self._signature.bind(*args, **kwargs)
        eager_first_call(self.model, self.model, bound, seq_dims, self.world, site)
        what = "hooks installed on the first call" if hook else "a break"
        self.backend.graph_breaks.append(
            f"{what} at {site}: AutoSP made one eager call (no grad, local-length inputs, RNG "
            f"and buffers restored) before tracing. Fix: {FIX}")
        return self.compiled(*args, **kwargs)


def autosp_compile(model: torch.nn.Module, sp_group=None, *, sac: bool = True,
                   backend: str = "inductor", sac_budget: Optional[float] = None,
                   verbose: bool = True, attention_output_once: bool = True,
                   chunked_loss: bool = True, param_sharding: str = "none",
                   reshard_after_forward: bool = True,
                   ulysses_degree: Optional[int] = None, refuse_plans: tuple = (), **options: Any) -> AutoSPRunner:
    """Compile ``model`` for Ulysses-style sequence parallelism over ``sp_group`` (default: world).

    Call the result like the model with the *full* global-length batch on every rank; the
    returned loss is the single-device loss (identical on every rank), outputs carrying the
    sequence are this rank's shard, and summing parameter gradients over ``sp_group`` gives the
    single-device gradient. ``run.report`` describes what the passes did.

    With ``sac`` on, ``attention_output_once`` (default) keeps each attention output only in the
    sequence layout for the backward (:mod:`~autosp_lm.compiler.passes.attention_output_once`);
    pass False to hand the attention kernel's backward its own output as saved (one more
    ``[B, H/P, S, D]`` tensor per layer). With ``sac`` on, ``chunked_loss`` (default) fuses a
    ``linear -> cross_entropy`` loss head into one op that recomputes the logits in sequence
    chunks in the backward (:mod:`~autosp_lm.compiler.passes.fuse_loss_head`).

    ``ulysses_degree``: ``U`` of the 2-D plan ``P = U x R`` (:mod:`~autosp_lm.compiler.passes.plan`):
    all-to-all over heads in groups of ``U`` consecutive ranks, ring attention over the ``R``
    groups, on the load-balanced zigzag layout (then the sequence length must be a multiple of
    ``2P``, and outputs that carry the sequence come back in that layout:
    :meth:`AutoSPRunner.local_positions`). None: chosen from the head counts and the node size.

    ``param_sharding="graph_fsdp"``: the model's parameters were sharded by
    :func:`autosp_lm.parallel.fsdp_graph.graph_fully_shard`; their all-gathers are re-gathered in
    the backward (``reshard_after_forward``, default) or kept from the forward
    (:mod:`~autosp_lm.compiler.passes.tag_param_gathers`).

    ``options``: the other fields of :class:`~autosp_lm.compiler.pipeline.AutoSPOptions` —
    ``sac_recommunicate`` (False: never re-communicate), ``sac_device`` (cost-model device
    preset), ``sac_memory_target`` (bytes), ``offload_activations``, ``offload_threshold``,
    ``sequence_tiling``, ``tile_chunk_tokens`` (``docs/sac.md``); ``schedule_timeout``,
    ``schedule_grace`` (seconds: the compile-time check that every rank runs the same
    collectives, :mod:`~autosp_lm.compiler.schedule`; a difference is an AutoSPError).

    ``refuse_plans`` (``"rows"``: token routing, ``"region"``: hand-written attention,
    ``"blocks"``: a chunked scan's cut of the sequence into blocks, ``"heads"``: head-parallel
    regions for ops without a sharding rule) makes those ops take the gather fallback instead,
    to measure what the plans save.
    """
    options = AutoSPOptions(sac=sac, backend=backend, sac_budget=sac_budget, verbose=verbose,
                            attention_output_once=attention_output_once,
                            chunked_loss=chunked_loss, param_sharding=param_sharding,
                            reshard_after_forward=reshard_after_forward,
                            ulysses_degree=ulysses_degree, refuse_plans=tuple(refuse_plans),
                            **options)
    return AutoSPRunner(model, sp_group, options)


def _attach(compiled: Any, backend: SACBackend) -> Any:
    if isinstance(compiled, torch.nn.Module):
        # OptimizedModule forwards unknown attribute writes to the wrapped model; give the
        # compiled wrapper its own small subclass that carries the backend instead.
        base = type(compiled)
        cls = type("SACCompiledModule", (base,), {
            "_sac_backend": None,
            "sac_stats": property(lambda self: self._sac_backend.stats),
            "sac_budget": property(lambda self: self._sac_backend.options.sac_budget),
            "sac_fused_losses": property(lambda self: self._sac_backend.fused_losses),
        })
        compiled.__class__ = cls
        compiled._sac_backend = backend
    else:
        compiled.sac_stats = backend.stats
        compiled.sac_budget = backend.options.sac_budget
        compiled.sac_fused_losses = backend.fused_losses
        compiled._sac_backend = backend
    return compiled


def sac_compile(model: Callable, *, budget: float = DEFAULT_BUDGET, backend: str = "inductor",
                dynamic: Optional[bool] = None, fullgraph: bool = False,
                chunked_loss: bool = True) -> Any:
    """Compile ``model`` (an ``nn.Module`` or function) for single-device training with SAC.

    ``budget``: recompute at most ``budget`` x the step's FLOPs (``--sac-recompute-budget``).
    ``backend``: ``"inductor"`` (default) or ``"aot_eager"``. Returns the compiled callable; its
    ``.sac_stats`` is the live list of per-graph SAC stats (filled at the first training call).
    ``chunked_loss``: fuse ``linear -> cross_entropy`` loss heads into one op that recomputes
    the logits in sequence chunks; listed in ``.sac_fused_losses``.

    Every call owns its backend object: compiling two models in one process gives each its own
    budget and stats.
    """
    sac_backend = SACBackend(AutoSPOptions(sac=True, backend=backend, sac_budget=budget,
                                           chunked_loss=chunked_loss))
    compiled = torch.compile(model, backend=sac_backend, dynamic=dynamic, fullgraph=fullgraph)
    return _attach(compiled, sac_backend)
