"""``autosp_compile``: an unchanged single-device model -> a sequence-parallel training callable."""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.distributed as dist

from .backend import AutoSPBackend
from .common import AutoSPError

SEQUENCE_ARGUMENTS = ("input_ids", "labels", "position_ids", "attention_mask")
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


class AutoSPRunner:
    """What :func:`autosp_compile` returns: call it like the model."""

    def __init__(self, model: torch.nn.Module, sp_group=None, *, sac: bool = True,
                 backend: str = "inductor", sac_budget: Optional[float] = None,
                 verbose: bool = True, attention_output_once: bool = True,
                 chunked_loss: bool = True):
        self.model = model
        self.sp_group = sp_group
        self.backend = AutoSPBackend(sp_group, sac=sac, backend=backend, sac_budget=sac_budget,
                                     verbose=verbose, attention_output_once=attention_output_once,
                                     chunked_loss=chunked_loss)
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

    def report_text(self) -> str:
        return self.report.text() if self.report is not None else "AutoSP: not compiled yet"

    def _mark(self, args, kwargs) -> None:
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
        lengths = []
        for name, value in items:
            dims = _sequence_dims(name, value)
            if not dims:
                continue
            for d in dims:
                lengths.append((name, value.size(d)))
                torch._dynamo.mark_dynamic(value, d)
            for d in range(value.dim()):
                if d not in dims:  # one dim at a time: list arguments are newer than torch 2.11
                    torch._dynamo.mark_static(value, d)
        if not lengths:
            raise AutoSPError("AutoSP: no sequence input in this call; pass input_ids/labels/"
                              "position_ids/attention_mask by name or use mark_sequence(t, dim)")
        P = self.world
        sizes = {s for _, s in lengths}
        if len(sizes) != 1:
            raise AutoSPError("AutoSP: sequence inputs have different lengths: "
                              + ", ".join(f"{n}={s}" for n, s in lengths))
        S = sizes.pop()
        if S % P:
            raise AutoSPError(f"AutoSP: sequence length {S} is not divisible by the "
                              f"sequence-parallel size {P}; pad or cut the sequence to a multiple "
                              f"of {P}")

    def __call__(self, *args, **kwargs):
        self._mark(args, kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, AutoSPError):
                raise inner from None
            raise
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise AutoSPError(
                "AutoSP needs the whole model as one graph (fullgraph=True) but Dynamo could not "
                f"trace it without a graph break: {first}\n"
                "Remove the break (data-dependent Python control flow, .item()/.tolist(), "
                "unsupported calls) from the model's forward.") from e


def autosp_compile(model: torch.nn.Module, sp_group=None, *, sac: bool = True,
                   backend: str = "inductor", sac_budget: Optional[float] = None,
                   verbose: bool = True, attention_output_once: bool = True,
                   chunked_loss: bool = True) -> AutoSPRunner:
    """Compile ``model`` for Ulysses-style sequence parallelism over ``sp_group`` (default: world).

    Call the result like the model with the *full* global-length batch on every rank; the
    returned loss is the single-device loss (identical on every rank), outputs carrying the
    sequence are this rank's shard, and summing parameter gradients over ``sp_group`` gives the
    single-device gradient. ``run.report`` describes what the passes did.

    With ``sac`` on, ``attention_output_once`` (default) keeps each attention output only in the
    sequence layout for the backward (:mod:`autosp_lm.compiler.attention_out`); pass False to
    hand the attention kernel's backward its own output as saved (one more ``[B, H/P, S, D]``
    tensor per layer). With ``sac`` on, ``chunked_loss`` (default) fuses a ``linear ->
    cross_entropy`` loss head into one op that recomputes the logits in sequence chunks in the
    backward (:mod:`autosp_lm.compiler.chunked_loss`).
    """
    return AutoSPRunner(model, sp_group, sac=sac, backend=backend, sac_budget=sac_budget,
                        verbose=verbose, attention_output_once=attention_output_once,
                        chunked_loss=chunked_loss)
