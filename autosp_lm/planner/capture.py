"""The partitioned graphs of a compiled training step, captured, and their live memory at any length.

:func:`capture_backend` is a ``torch.compile`` backend that runs AOTAutograd with the min-cut
partitioner and op-by-op execution (what ``aot_eager`` does) and records every partitioned
forward/backward pair in a list: the graphs of the hand-written strategies, simulated exactly as
AutoSP's (whose backend records its own pairs: ``AutoSPBackend.partitions``).

:func:`length_size_of` evaluates a fake value's bytes at another sequence length: a graph traced
with the sequence dimension dynamic carries sizes as sympy expressions of one symbol whose hint is
the traced length; substituting another length gives that graph's sizes there exactly. A symbol
whose hint is not the traced length (a second dynamic size) is refused, never guessed.
:func:`simulate_captured` is :func:`~autosp_lm.planner.liveness.simulate_step` of every captured
pair at one length (graph breaks: the pairs run one after the other; what a pair hands to the next
is not modelled: our strategies compile one graph).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from ..compiler.chunking import probing
from ..compiler.graph import AutoSPError
from ..compiler.passes import checkpoint_outputs
from ..compiler.passes.offload_activations import offload_checkpoint_inputs
from ..compiler.passes.sac_graph import flat_outputs
from ..compiler.aot import boxed_nop
from .liveness import LiveMemory, simulate_step, storage_root
from .workspace import TensorSpec

__all__ = ["Partition", "capture_backend", "custom_op_inner_peak", "length_size_of",
           "simulate_captured"]


@dataclass
class Partition:
    """One partitioned step: the forward, the backward and the number of the user's outputs of
    the forward (the rest are saved for the backward)."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    num_fwd_outputs: int


def capture_backend(store: list, offload_checkpoints: bool = False) -> Callable:
    """A ``torch.compile`` backend: AOTAutograd, the min-cut partitioner (AOTAutograd's
    defaults), no code generation; every partition is appended to ``store`` as a
    :class:`Partition`. ``offload_checkpoints``: the program then keeps the checkpoints' saved
    inputs in host memory, as the recipes' compiled ``--cpu-offloading`` does
    (:func:`~autosp_lm.compiler.passes.offload_activations.offload_checkpoint_inputs`)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        # as the hand-written strategies' compiled recipes do (looked up at the call: tests
        # switch it off)
        checkpoint_outputs.save_region_outputs(joint)
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs,
                                                     num_fwd_outputs=num_fwd_outputs, **kwargs)
        if offload_checkpoints:
            offload_checkpoint_inputs(fw, bw, num_fwd_outputs)
        store.append(Partition(fw, bw, num_fwd_outputs))
        return fw, bw

    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
                           keep_inference_input_mutations=True)
    backend.__name__ = "capture"
    return backend


def _expr(s):
    if isinstance(s, int):
        return s
    return s.node.expr


def length_size_of(traced_length: int, length: int, hints: dict) -> Callable:
    """``size_of`` for :func:`simulate_step`: a tensor's bytes with every symbol of its shape
    whose hint (``hints``: the shape environment's symbol -> traced value) is ``traced_length``
    set to ``length`` (static sizes unchanged)."""
    import sympy
    cache: dict = {}

    def value(e) -> int:
        if isinstance(e, int):
            return e
        v = cache.get(e)
        if v is None:
            subs = {}
            for sym in e.free_symbols:
                hint = hints.get(sym)
                if hint != traced_length:
                    raise AutoSPError(
                        f"memory plan: a size of the traced graph depends on {sym} (traced as "
                        f"{hint}), which is not the sequence length ({traced_length}); only the "
                        f"sequence dimension may be dynamic: mark the others static")
                subs[sym] = length
            r = sympy.sympify(e).xreplace(subs)
            try:
                v = cache[e] = int(r)
            except TypeError:
                raise AutoSPError(f"memory plan: the size {e} does not evaluate at length "
                                  f"{length}") from None
        return v

    def size_of(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        n = 1
        for s in t.shape:
            n *= value(_expr(s))
        return n * t.element_size()

    size_of.value = value
    return size_of


def _hints(p: Partition) -> dict:
    """Symbol -> traced value of the shape environment of a captured pair ({} when static)."""
    for n in p.fw.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            for s in v.shape:
                if isinstance(s, torch.SymInt):
                    env = s.node.shape_env  # backed_var_to_val: torch >= 2.13's name
                    vals = getattr(env, "backed_var_to_val", None)
                    return {k: int(x) for k, x in (vals if vals is not None
                                                   else env.var_to_val).items()}
    return {}


def _scaled_grads(bw: fx.GraphModule, size_of: Callable, fraction: float) -> Callable:
    grads = set()
    for o in flat_outputs(bw.graph):
        if isinstance(o, fx.Node):
            v = storage_root(o).meta.get("val")
            if isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape):
                grads.add(id(v))

    def scaled(t) -> int:
        n = size_of(t)
        return int(n * fraction) if id(t) in grads else n

    return scaled


def simulate_captured(partitions: list, traced_length: int, length: Optional[int] = None,
                      device: Optional[torch.device] = None,
                      grad_fraction: float = 1.0, inner_cache: Optional[dict] = None,
                      walks: Optional[dict] = None,
                      workspace: Optional[Callable] = None,
                      clock: Optional[Callable] = None) -> LiveMemory:
    """The live memory of the captured step at ``length`` (default: the traced length): the
    pairs simulated in order, the peak the largest of theirs, the saved bytes their sum.
    ``grad_fraction``: the backward's outputs of static shape (the parameters' gradients) count
    that fraction of their bytes (sharded gradients: 1 / the shard count). ``inner_cache``: the
    custom ops' inner peaks by (op, concrete input shapes), kept across calls on the same graphs
    (a length seen before, or an op whose inputs do not depend on the length, is not run again);
    ``walks``: the graphs' size-independent analysis, kept across calls
    (:func:`~autosp_lm.planner.liveness.simulate_graph`). ``workspace``: the attention kernels'
    own scratch on the step's device (:func:`~autosp_lm.planner.workspace.kernel_workspace`),
    counted while each such op runs, in the graphs and inside custom ops' bodies (None: op
    outputs only). ``LiveMemory.host`` sums the pairs' host bytes (the offload ops' copies).
    ``clock(partition, ratio)``: a CUDA step's streams for that pair at ``ratio`` times the
    traced length (:class:`~autosp_lm.planner.liveness.Clock`): the offloaded values' device
    memory is freed when their copy ends, and ``LiveMemory.stall_s`` is the compute stream's
    wait for copies back; None: synchronous copies (CPU)."""
    if not partitions:
        raise AutoSPError("memory plan: no partitioned graph was captured (did the step run "
                          "backward through the compiled model?)")
    best, saved, host, stall = None, 0, 0, 0.0
    simulate_captured.not_counted = {}
    L = traced_length if length is None else length
    for p in partitions:
        size_of = length_size_of(traced_length, L, _hints(p))
        inner = custom_op_inner_peak(size_of.value, cache=inner_cache, workspace=workspace)
        if grad_fraction != 1.0:
            size_of = _scaled_grads(p.bw, size_of, grad_fraction)
        m = simulate_step(p.fw, p.bw, p.num_fwd_outputs, device=device, size_of=size_of,
                          inner_peak=inner, walks=walks,
                          clock=clock(p, L / traced_length) if clock is not None else None)
        simulate_captured.not_counted.update(inner.not_counted)
        saved += m.saved
        host += m.host
        stall += m.stall_s
        if best is None or m.peak > best.peak:
            best = m
    return LiveMemory(best.peak, best.peak_at, best.peak_phase, best.forward_peak, saved,
                      best.backward_peak, host, stall)


class _LiveBytes:
    """A dispatch mode counting the bytes of the storages created under it that are still
    referenced (through any tensor), and their peak."""

    def __init__(self, known: set, workspace: Optional[Callable] = None):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        ws_ops = getattr(workspace, "ops", ())

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker.created(out)
                if func in ws_ops:  # the kernel's scratch, live with its outputs while it runs
                    specs = [TensorSpec.of(a) if isinstance(a, torch.Tensor) else a
                             for a in args]
                    tracker.peak = max(tracker.peak, tracker.live + workspace(func, specs))
                return out

        self.mode = Mode()
        self.known, self.refs = set(known), {}
        self.live = self.peak = 0

    def created(self, out) -> None:
        import weakref

        from torch.utils._pytree import tree_flatten
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key in self.known:
                continue
            if key not in self.refs:
                self.refs[key] = [t.untyped_storage().nbytes(), 0]
                self.live += self.refs[key][0]
                self.peak = max(self.peak, self.live)
            self.refs[key][1] += 1
            weakref.finalize(t, self._release, key)

    def _release(self, key) -> None:
        ref = self.refs.get(key)
        if ref is not None:
            ref[1] -= 1
            if ref[1] == 0:
                self.live -= ref[0]
                del self.refs[key]


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


_TORCH_NAMESPACES = ("aten", "prims", "_c10d_functional", "c10d", "_c10d_functional_autograd")


def _custom_op_impl(target) -> Optional[Callable]:
    """The Python implementation of a ``torch.library.custom_op`` overload (None otherwise)."""
    from torch._library.custom_ops import OPDEFS
    schema = getattr(target, "_schema", None)
    if schema is None or schema.name.split("::")[0] in _TORCH_NAMESPACES:
        return None
    opdef = OPDEFS.get(schema.name)
    return getattr(opdef, "_init_fn", None) if opdef is not None else None


def custom_op_inner_peak(value_of: Callable, cache: Optional[dict] = None,
                         workspace: Optional[Callable] = None) -> Callable:
    """``inner_peak`` for :func:`simulate_step`: a custom op (``torch.library.custom_op``, whose
    body the graph does not show, e.g. ring attention's loop over its blocks) runs its Python
    implementation on fake tensors of the node's input shapes (``value_of``: a size expression
    -> int at the simulated length) while every storage it creates is counted; an op with a
    kernel workspace (``workspace``: :func:`~autosp_lm.planner.workspace.kernel_workspace`, also
    applied to the ops a body calls) counts its outputs and that scratch; other ops: None.
    The body's collectives need the (fake) process group the step was traced in. ``cache``:
    (op, concrete arguments) -> (peak, why not counted), shared between calls if given."""
    cache = {} if cache is None else cache
    ws_ops = getattr(workspace, "ops", ())

    def spec(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return TensorSpec.of(v, lambda s: value_of(_expr(s)))
            return v
        return a

    def with_workspace(n: fx.Node) -> int:
        outs = n.meta.get("val")
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        total = 0
        for t in outs:
            if isinstance(t, torch.Tensor):
                total += math.prod(value_of(_expr(s)) for s in t.shape) * t.element_size()
        return total + workspace(n.target, [spec(a) for a in n.args])

    def value_sig(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(value_of(_expr(s)) for s in v.shape), v.dtype, v.device)
        if isinstance(v, torch.SymInt):
            return ("S", value_of(_expr(v)))
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(value_sig(x) for x in v))
        return ("V", repr(v))

    def signature(a):
        """The argument with every size evaluated at the simulated length (the cache key)."""
        if isinstance(a, fx.Node):
            return value_sig(a.meta.get("val"))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(signature(x) for x in a))
        return ("V", repr(a))

    def inner(n: fx.Node) -> Optional[int]:
        n = unwrap_rng(n)
        if n.op == "call_function" and n.target in ws_ops:
            return with_workspace(n)
        impl = _custom_op_impl(n.target) if n.op == "call_function" else None
        if impl is None or _is_offload_op(n):  # the offload ops allocate their outputs only
            return None  # (and their bodies keep the trainer's state: never run them here)
        key = (n.target, signature(tuple(n.args)), signature(tuple(n.kwargs.items())),
               getattr(workspace, "target", None))
        if key not in cache:
            cache[key] = _run_body(impl, n, value_of, workspace)
        peak, why = cache[key]
        if why is not None:
            inner.not_counted[str(n.target)] = why
        return peak

    inner.not_counted = {}
    return inner


def _is_offload_op(n) -> bool:
    name = getattr(getattr(n.target, "_schema", None), "name", "")
    return name in ("autosp_lm::offload", "autosp_lm::reload")


def unwrap_rng(n: fx.Node):
    """An activation checkpoint's RNG wrapper (``higher_order.run_and_save_rng_state`` /
    ``run_with_rng_state``, a node without a value) as the op it runs: a stand-in node with that
    op, its arguments and, as its value, the outputs its ``getitem``s take (the RNG state apart),
    so the op's workspace or custom body is counted where the wrapper runs; other nodes as
    they are."""
    import operator
    import types
    name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
    if name not in ("run_and_save_rng_state", "run_with_rng_state") or n.meta.get("val") \
            is not None:
        return n
    target, args = (n.args[0], n.args[1:]) if name == "run_and_save_rng_state" else \
        (n.args[1], n.args[2:])
    outs, todo = [], [(u, name == "run_and_save_rng_state") for u in n.users]
    while todo:
        u, top_save = todo.pop()
        if u.target is not operator.getitem or (top_save and u.args[1] == 0):
            continue  # not an output, or the saved RNG state
        if isinstance(u.meta.get("val"), torch.Tensor):
            outs.append(u.meta["val"])
        todo.extend((w, False) for w in u.users)
    return types.SimpleNamespace(op="call_function", target=target, args=tuple(args),
                                 kwargs=dict(n.kwargs), meta={"val": outs})


def _run_body(impl: Callable, n: fx.Node, value_of: Callable,
              workspace: Optional[Callable] = None) -> tuple:
    """(peak bytes of the storages ``impl`` creates on fake inputs of ``n``'s shapes, None) or
    (None, why it could not run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made = []

    def concrete(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                shape = tuple(value_of(_expr(s)) for s in v.shape)
                with mode:
                    t = torch.empty(shape, dtype=v.dtype, device=v.device)
                made.append(t)
                return t
            if isinstance(v, torch.SymInt):
                return value_of(_expr(v))
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(concrete(x) for x in a)
        return a

    args = [concrete(a) for a in n.args]
    kwargs = {k: concrete(v) for k, v in n.kwargs.items()}
    tracker = _LiveBytes({_storage_key(t) for t in made}, workspace)
    try:
        # a loop over alike chunks runs one chunk of each size: the same peak, without the
        # thousands of iterations of a multi-million-token step (compiler/chunking.py)
        with mode, tracker.mode, probing():
            impl(*args, **kwargs)  # its outputs die here: only the peak is kept
        return tracker.peak, None
    except Exception as e:  # noqa: BLE001 - a body that cannot run on fake tensors
        return None, f"{type(e).__name__}: {e}"[:200]  # its outputs only (reported)
