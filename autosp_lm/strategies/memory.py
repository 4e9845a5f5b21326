"""The memory techniques users switch on with the hand-written strategies (none, Ulysses, Ring).

A baseline is what a competent user of that recipe runs, so the hand-written strategies carry
the same memory techniques as their peers, applied from outside to the unchanged model:

* **Megatron's activation recomputation** (``--recompute-granularity``, ``--recompute-method``,
  ``--recompute-num-layers``, with Megatron-LM's meaning):

  - ``full``: keep only the input of a checkpointed transformer block and recompute the block in
    the backward (PyTorch's non-reentrant ``torch.utils.checkpoint``). ``uniform``: the blocks in
    groups of N, each group one checkpoint (only its first block's input kept); ``block``: the
    first N blocks each checkpointed, the others keep their activations.
  - ``selective``: recompute the attention core only (the call behind the model's attention
    entry point, with the strategy's communication, as Megatron's checkpointed core attention).

* **The ALST recipe** (Arctic Long Sequence Training):

  - ``chunked_loss``: the output projection and the cross entropy as one op over token chunks
    (:func:`autosp_lm.compiler.ops.linear_cross_entropy`, the op AutoSP's loss-head fusion
    inserts): the ``[tokens, vocab]`` logits never exist;
  - ``tiled_mlp``: each block's MLP run over sequence chunks in one op, each chunk recomputed
    in the backward, so one chunk's ``[chunk, ffn]`` intermediate is live at a time (ALST's
    chunk: about ``hidden`` tokens; :mod:`.tiled_mlp`);
  - ``cpu_offloading``: the inputs that the full recomputation keeps (one per checkpoint) are
    copied to pinned host memory in the forward and brought back in the backward (Megatron's
    flag names; Megatron offloads whole layers' activations, ALST the checkpointed hidden
    states, which is what this does). Eager: saved-tensor hooks, each checkpoint's inputs
    brought back one checkpoint ahead. Compiled (``--compile``, the program the memory planner
    traces): the same values, chosen on the partitioned graphs
    (:func:`~autosp_lm.compiler.passes.offload_activations.offload_checkpoint_inputs`), moved
    by the offload ops AutoSP uses (:mod:`autosp_lm.compiler.offload`: a side stream,
    :data:`~autosp_lm.compiler.offload.PREFETCH` slots brought back ahead).

Everything is installed on the model's modules by patching instance ``forward`` attributes, so
parameter names, state dicts and FSDP2's module hooks stay as they are (the hooks run around the
patched forward; the recomputation runs inside the unit's backward, after FSDP2 gathered it
again). The result is exact: recomputation replays the same ops with the same RNG state, and the
chunked loss sums the same per-token losses (fp32 rounding apart).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..models.attention import get_attention, sdpa_attention, use_attention
from ..parallel.fsdp import block_list
from .tiled_mlp import TiledMLP

#: why ``--cpu-offloading --compile`` is refused under ``--use-torch-fsdp2`` (also by
#: ``arguments.validate_sharding_args``, before any work)
FSDP2_COMPILED_OFFLOAD = (
    "--cpu-offloading with --compile offloads what the compiled graph saves, and under "
    "--use-torch-fsdp2 each block is a graph of its own whose input the graph does not make: "
    "nothing would leave the device; drop --compile (the eager recipe offloads through "
    "saved-tensor hooks) or --use-torch-fsdp2")
GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
#: submodule names of a block's MLP that ``tiled_mlp`` recognises
MLP_NAMES = ("mlp", "feed_forward", "ffn", "mlp_block")


@dataclass
class RecipeOptions:
    """The memory flags shared by none, ``--ulysses`` and ``--ring`` (fields of their options)."""

    recompute_granularity: Optional[str] = None  # None | "full" | "selective"
    recompute_method: str = "uniform"  # with full: "uniform" | "block"
    recompute_num_layers: int = 1  # uniform: blocks per checkpoint; block: blocks checkpointed
    chunked_loss: Optional[bool] = None  # None: off (none with --compile --sac: the SAC default)
    tiled_mlp: bool = False
    tiled_mlp_chunk_tokens: int = 0  # 0: the hidden size (ALST's ceil(tokens / hidden) chunks)
    cpu_offloading: bool = False  # the full recomputation's kept inputs in pinned host memory
    cpu_offloading_num_layers: int = 0  # 0: every checkpoint; N: the first N checkpoints

    def __post_init__(self):
        check_recipe(self)

    @property
    def recipe_on(self) -> bool:
        return bool(self.recompute_granularity or self.chunked_loss or self.tiled_mlp
                    or self.cpu_offloading)


def check_recipe(o, compiled: bool = False) -> None:
    """ValueError naming the flag and the fix for a combination the recipe cannot run."""
    if o.recompute_granularity not in (None,) + GRANULARITIES:
        raise ValueError(f"--recompute-granularity must be one of {', '.join(GRANULARITIES)}, "
                         f"got {o.recompute_granularity!r}")
    if o.recompute_method not in METHODS:
        raise ValueError(f"--recompute-method must be one of {', '.join(METHODS)}, got "
                         f"{o.recompute_method!r}")
    if o.recompute_num_layers < 1:
        raise ValueError(f"--recompute-num-layers must be >= 1, got {o.recompute_num_layers}")
    if o.tiled_mlp_chunk_tokens < 0:
        raise ValueError(f"--tiled-mlp-chunk-tokens must be >= 0, got {o.tiled_mlp_chunk_tokens}")
    if o.cpu_offloading_num_layers < 0:
        raise ValueError(f"--cpu-offloading-num-layers must be >= 0, got "
                         f"{o.cpu_offloading_num_layers}")
    if o.cpu_offloading and o.recompute_granularity != "full":
        raise ValueError("--cpu-offloading moves the inputs kept by the full recomputation to host "
                         "memory: add --recompute-granularity full")
    if o.cpu_offloading and compiled and o.cpu_offloading_num_layers:
        raise ValueError("--cpu-offloading-num-layers picks checkpoints of the eager recipe; "
                         "compiled, every checkpoint's inputs are offloaded: drop "
                         "--cpu-offloading-num-layers or --compile")


def describe_recipe(o) -> str:
    """One line for the start-up report ('' when nothing is on)."""
    parts = []
    if o.recompute_granularity == "full":
        n = o.recompute_num_layers
        parts.append(f"full recomputation ({o.recompute_method}, "
                     + (f"{n} block(s) per checkpoint" if o.recompute_method == "uniform"
                        else f"the first {n} block(s)") + ")")
    elif o.recompute_granularity == "selective":
        parts.append("selective recomputation (attention core)")
    if o.chunked_loss:
        parts.append("chunked loss head (no [tokens, vocab] logits)")
    if o.tiled_mlp:
        parts.append("tiled MLP (" + (f"{o.tiled_mlp_chunk_tokens} tokens per chunk"
                                      if o.tiled_mlp_chunk_tokens else "hidden-size chunks") + ")")
    if o.cpu_offloading:
        parts.append("checkpointed block inputs offloaded to host memory"
                     + (f" (first {o.cpu_offloading_num_layers} checkpoints)"
                        if o.cpu_offloading_num_layers else ""))
    return "; ".join(parts)


# ============================================================================ host offload
class _HostCopy:
    """One saved tensor in host memory; ``prefetch`` starts its copy back ahead of the unpack."""

    __slots__ = ("host", "device", "pending", "event", "stored")

    def __init__(self, t: torch.Tensor, stream):
        self.device = t.device
        self.pending = None
        self.event = None
        self.stored = None  # the device-to-host copy's completion
        if t.device.type == "cuda":
            self.host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
                self.stored = torch.cuda.Event()
                self.stored.record(stream)
            t.record_stream(stream)  # the device block lives until the copy is done
        else:  # no separate host memory: a copy, so the path is the one a GPU runs
            self.host = t.detach().clone()

    def prefetch(self, stream) -> None:
        if self.device.type != "cuda" or self.pending is not None:
            return
        with torch.cuda.stream(stream):
            self.pending = self.host.to(self.device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def fetch(self) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.host
        cur = torch.cuda.current_stream(self.device)
        if self.pending is None:  # not prefetched: copy back on this stream, after the store
            cur.wait_event(self.stored)
            return self.host.to(self.device, non_blocking=True)
        t, self.pending = self.pending, None
        cur.wait_event(self.event)
        t.record_stream(cur)
        return t

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


class HostOffload:
    """The saved-tensor hooks of one step's offloaded checkpoints.

    ``hooks(i)`` is entered around checkpoint ``i``'s forward call: the tensors that checkpoint
    keeps (its inputs) are packed into host copies (a tensor several checkpoints share, such as
    RoPE's cos/sin, is copied once). Unpacking checkpoint ``i``'s inputs in the backward starts
    the copy back of checkpoint ``i - 1``'s, which the backward reaches next."""

    def __init__(self):
        self.stream = None
        self.groups: list = []
        self._seen: dict = {}
        self.host_bytes = 0  # of the last forward

    def start_step(self) -> None:
        self.groups, self._seen, self.host_bytes = [], {}, 0

    def hooks(self, index: int):
        while len(self.groups) <= index:
            self.groups.append([])
        group = self.groups[index]

        def pack(t: torch.Tensor):
            key = id(t)
            hit = self._seen.get(key)
            if hit is not None and hit[0]() is t:
                h = hit[1]
            else:
                if t.device.type == "cuda" and self.stream is None:
                    self.stream = torch.cuda.Stream(t.device)
                h = _HostCopy(t, self.stream)
                self._seen[key] = (weakref.ref(t), h)
                self.host_bytes += h.nbytes
            group.append(h)
            return (index, h)

        def unpack(packed):
            i, h = packed
            t = h.fetch()
            if i > 0 and i - 1 < len(self.groups):
                for other in self.groups[i - 1]:
                    other.prefetch(self.stream)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# ============================================================================ the patches
def _checkpointed(fns: list, offload: Optional[HostOffload], index: int):
    """A forward that runs ``fns`` (forwards of consecutive blocks) as one checkpoint."""

    def run(attention_impl, *args, **kwargs):
        def body(*a, **k):
            x = a[0]
            for f in fns:
                x = f(x, *a[1:], **k)
            return x

        if torch.compiler.is_compiling():
            return body(*args, **kwargs)
        # the recomputation runs in the backward: the strategy's attention must be installed
        with use_attention(attention_impl):
            return body(*args, **kwargs)

    def forward(*args, **kwargs):
        impl = None if torch.compiler.is_compiling() else get_attention()
        if offload is not None and torch.is_grad_enabled():
            with offload.hooks(index):
                return checkpoint(run, impl, *args, use_reentrant=False, **kwargs)
        return checkpoint(run, impl, *args, use_reentrant=False, **kwargs)

    return forward


def _pass_through(x, *args, **kwargs):
    return x


def _is_fsdp_unit(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def _find_head(model: nn.Module) -> nn.Linear:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        for name in ("lm_head", "output", "output_layer"):
            head = getattr(model, name, None)
            if isinstance(head, nn.Linear):
                break
            head = None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"--chunked-loss: cannot find the output projection of "
                         f"{type(model).__name__} (an nn.Linear from get_output_embeddings() or "
                         f"named lm_head / output); drop --chunked-loss")
    return head


class ChunkedLossHead:
    """The output projection patched to return the summed cross entropy of ``labels`` (set by
    the strategy around the model call) instead of logits: the projection and the loss run as
    one chunked op inside the head's own call, so FSDP2 has its weight gathered."""

    def __init__(self, head: nn.Linear):
        self.head = head
        self.labels: Optional[torch.Tensor] = None
        self.returned: Optional[torch.Tensor] = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from ..compiler.ops import linear_cross_entropy
        labels = self.labels
        if labels is None:
            raise RuntimeError("--chunked-loss: the output layer ran without labels (the model "
                               "was called outside the strategy's forward_loss)")
        if self.returned is not None:
            raise ValueError("--chunked-loss: the model calls its output layer more than once "
                             "per forward; drop --chunked-loss")
        if h.shape[:-1] != labels.shape:
            raise ValueError(f"--chunked-loss: the output layer's input {tuple(h.shape)} does "
                             f"not match the labels {tuple(labels.shape)}; the model must apply "
                             f"its output layer to every position (drop --chunked-loss)")
        out = linear_cross_entropy(h.reshape(-1, h.shape[-1]), labels.reshape(-1),
                                   self.head.weight, self.head.bias, reduction="sum")
        self.returned = out
        return out

    def result(self, out) -> torch.Tensor:
        """The model's output must be the head's loss itself (a model that transforms its
        logits after the output layer, e.g. soft-capping, cannot use the fused head)."""
        returned, self.returned = self.returned, None
        if returned is None or out is not returned:
            raise ValueError("--chunked-loss: the model does not return its output layer's "
                             "result unchanged (it transforms or slices the logits); drop "
                             "--chunked-loss")
        return out


class MemoryRecipe:
    """The recipe of ``options`` installed on ``model`` (undone by :meth:`remove`)."""

    def __init__(self, model: nn.Module, options):
        self.options = options
        self.model = model
        self.offload: Optional[HostOffload] = None
        self.head: Optional[ChunkedLossHead] = None
        self._undo: list = []
        self.checkpoints = 0
        self.tiled = 0
        self.compiled = bool(getattr(options, "compile", False))
        try:
            self._install()
        except Exception:
            self.remove()
            raise

    def _patch(self, module: nn.Module, forward: Callable) -> None:
        had = "forward" in module.__dict__
        old = module.__dict__.get("forward")
        self._undo.append((module, had, old))
        module.forward = forward

    def _install(self) -> None:
        o, model = self.options, self.model
        blocks = block_list(model) if (o.recompute_granularity == "full" or o.tiled_mlp) else None
        if (o.recompute_granularity == "full" or o.tiled_mlp) and not blocks:
            raise ValueError(f"{type(model).__name__} has no list of transformer blocks (an "
                             f"nn.ModuleList) to checkpoint or tile")
        if o.tiled_mlp:
            for b in blocks:
                mlp = next((getattr(b, n) for n in MLP_NAMES
                            if isinstance(getattr(b, n, None), nn.Module)), None)
                if mlp is None:
                    raise ValueError(f"--tiled-mlp: block {type(b).__name__} has no MLP "
                                     f"submodule named {' / '.join(MLP_NAMES)}; drop --tiled-mlp")
                compiled = self.compiled and getattr(o, "backend", "") == "inductor"
                self._patch(mlp, TiledMLP(mlp, o.tiled_mlp_chunk_tokens, compiled))
                self.tiled += 1
        if o.cpu_offloading and self.compiled and any(_is_fsdp_unit(b) for b in blocks):
            raise ValueError(FSDP2_COMPILED_OFFLOAD)
        if o.recompute_granularity == "full":
            if o.cpu_offloading and not self.compiled:  # compiled: the graph's offload ops
                self.offload = HostOffload()
            n = o.recompute_num_layers
            if o.recompute_method == "block":
                groups = [[b] for b in list(blocks)[:n]]
            else:
                groups = [list(blocks)[i:i + n] for i in range(0, len(blocks), n)]
            limit = o.cpu_offloading_num_layers or len(groups)
            for i, group in enumerate(groups):
                if any(_is_fsdp_unit(b) for b in group[1:]):
                    raise ValueError(
                        "--recompute-method uniform with --recompute-num-layers > 1 runs several "
                        "blocks in one checkpoint, outside the FSDP2 hooks of all but the first: "
                        "use --recompute-num-layers 1 with --use-torch-fsdp2")
                fns = [b.forward for b in group]  # the (MLP-tiled) blocks' own forwards
                off = self.offload if i < limit else None
                self._patch(group[0], _checkpointed(fns, off, i))
                for b in group[1:]:
                    self._patch(b, _pass_through)  # ran inside the group's checkpoint
                self.checkpoints += 1
        if o.chunked_loss:
            self.head = ChunkedLossHead(_find_head(model))
            self._patch(self.head.head, self.head.forward)

    def attention(self, impl: Optional[Callable]) -> Optional[Callable]:
        """The attention implementation to install: ``impl`` (None: SDPA), checkpointed when
        the granularity is selective."""
        if self.options.recompute_granularity != "selective":
            return impl
        inner = impl or sdpa_attention

        def selective(q, k, v, **kwargs):
            return checkpoint(inner, q, k, v, use_reentrant=False, **kwargs)

        return selective

    def backend(self, backend: str):
        """The ``torch.compile`` backend for the recipe's model: with checkpointed regions,
        ``backend`` saving each region's output that the forward reads after it (as eager
        checkpointing does: :mod:`autosp_lm.compiler.passes.checkpoint_outputs`)."""
        o = self.options
        if not (o.recompute_granularity or o.tiled_mlp):
            return backend
        from ..compiler.passes.checkpoint_outputs import checkpointed_backend
        return checkpointed_backend(backend, offload=bool(o.cpu_offloading and self.compiled))

    def start_step(self) -> None:
        if self.offload is not None:
            self.offload.start_step()

    def remove(self) -> None:
        for module, had, old in reversed(self._undo):
            if had:
                module.forward = old
            else:
                module.__dict__.pop("forward", None)
        self._undo = []


__all__ = ["RecipeOptions", "MemoryRecipe", "ChunkedLossHead", "HostOffload", "TiledMLP",
           "check_recipe",
           "describe_recipe", "GRANULARITIES", "METHODS"]
