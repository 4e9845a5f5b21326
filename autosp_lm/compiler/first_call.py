"""First-call graph breaks: model code that installs hooks (or other state) the first time it
runs.

Some model code registers hooks inside ``forward`` on its first call (``if not self._hooked:
self.proj.register_forward_hook(...)``: statistics collectors, lazily attached adapters;
transformers 5 installs its output-capturing hooks under a ``threading.Lock`` on a model's first
call). Dynamo cannot trace a hook registration (nor a lock), so the whole-model graph AutoSP
needs breaks there. The break happens once: after one eager call the hooks exist and the code
path is not taken again. :func:`hook_install_site` recognises a hook registration (from
Dynamo's user stack) and names the line; :func:`break_site` names the line of any other break.
On the first traced call AutoSP makes the one eager call for the user (:func:`eager_first_call`)
when it is safe, and traces again; a break that is still there is the user's to remove:

* under ``torch.no_grad()`` on this rank's local-length piece of every sequence input (``S/P``
  positions), so it costs a fraction of a training step and no activation memory;
* the RNG states and every buffer are restored afterwards (dropout masks and running statistics
  of the compiled calls are the ones the model would have had without it);
* parameters must not change (checked by their version counters), otherwise it is refused.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from .graph import AutoSPError

#: the functions whose call inside a traced forward is the first-call hook break
HOOK_REGISTRARS = frozenset({
    "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_backward_hook", "register_hook",
    "register_post_accumulate_grad_hook", "register_module_forward_hook",
    "register_module_forward_pre_hook", "register_module_full_backward_hook"})

FIX = ("register the hooks in __init__ (or call the model once before autosp_compile) so that "
       "the first traced call does not install them")


def hook_install_site(exc: BaseException) -> Optional[str]:
    """``file:line: code`` of the model line that installs a hook, when ``exc`` is Dynamo's
    graph break on a hook registration; None for any other break."""
    stack = list(getattr(exc, "real_stack", None) or [])
    for i, frame in enumerate(stack):
        if frame.name in HOOK_REGISTRARS:
            user = stack[i - 1] if i > 0 else frame
            code = (user.line or "").strip()
            return f"{os.path.basename(user.filename)}:{user.lineno}: {code}"
    return None


def break_site(exc: BaseException) -> str:
    """``file:line: code`` of the model line where Dynamo's graph break ``exc`` happened (its
    innermost user frame), or ``"unknown line"``."""
    stack = list(getattr(exc, "real_stack", None) or [])
    if not stack:
        return "unknown line"
    f = stack[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno}: {(f.line or '').strip()}"


def _local_piece(value, dims, world: int):
    for d in dims:
        value = value.narrow(d, 0, value.size(d) // world)
    return value


def eager_first_call(model: torch.nn.Module, call: Callable, bound, seq_dims: dict,
                     world: int, site: str) -> None:
    """Run ``call(*bound.args, **bound.kwargs)`` eagerly once, safely (module docstring);
    ``seq_dims`` maps argument names to their sequence dims."""
    for name, value in bound.arguments.items():
        if isinstance(value, dict):  # **kwargs
            for k, v in value.items():
                if k in seq_dims:
                    value[k] = _local_piece(v, seq_dims[k], world)
        elif name in seq_dims:
            bound.arguments[name] = _local_piece(value, seq_dims[name], world)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    versions = {n: p._version for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        with torch.no_grad():
            call(*bound.args, **bound.kwargs)
    except Exception as e:  # noqa: BLE001 - reported with the line and the fix
        raise AutoSPError(
            f"AutoSP: the model's first traced call breaks the graph ({site}); the one eager "
            f"call AutoSP makes to get past a first-call break failed ({type(e).__name__}: "
            f"{e}). Fix: {FIX}") from e
    finally:
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers and b.shape == buffers[n].shape:
                    b.copy_(buffers[n])
    changed = [n for n, p in model.named_parameters() if versions.get(n, p._version) != p._version]
    if changed:
        raise AutoSPError(
            f"AutoSP: the model's first traced call breaks the graph ({site}); the eager call "
            f"made to get past this graph break changed parameters in place "
            f"({', '.join(changed[:3])}), so it is not safe to make for you. Fix: {FIX}")
