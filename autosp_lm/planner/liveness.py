"""Live tensor memory of a partitioned training step, simulated on its graphs (no execution).

:func:`simulate_step` walks the forward and backward graphs that the min-cut partitioner made
(what AOTAutograd runs), in execution order, on their fake values: every ``call_function``
that is not a view allocates its tensor outputs, a storage is freed after the last node that
reads it or any of its views, the saved tensors stay live from the forward to their last use
in the backward, and the forward's and backward's outputs stay live to the end. Sizes come from
the values' hints, so a graph traced with a symbolic sequence length is simulated at the traced
length (or at another length through ``size_of``). It models an op-by-op execution (aot_eager);
Inductor's fused kernels allocate fewer intermediates, so on Inductor it is an upper bound of
the intermediates, not of the saved tensors.

Not counted: the graphs' inputs (parameters, the batch: live before the step), tensors on another
device than the step's, and the optimizer's temporaries. **Host memory**: the host copies of
AutoSP's activation offload (``autosp_lm::offload``'s outputs) and the saved values a caller
names host-resident (``host_saved``: the ALST recipe's offloaded checkpoint inputs, traced without
the offload) are counted in ``LiveMemory.host``, not on the device; a host-resident saved value
is freed on the device after its last forward reader and comes back in the backward one group
ahead of its first reader (``prefetch``).
The result is what :class:`~autosp_lm.training.memory.LivePeak` measures around a forward and
backward (``tests/compiler/test_memory_passes.py`` compares them); the memory planner (issue 18)
builds on it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from ..compiler.graph import is_alias_op
from ..compiler import offload as offload_ops
from ..compiler.passes.sac_cost import tensor_bytes
from ..compiler.passes.sac_graph import flat_outputs

__all__ = ["Clock", "LiveMemory", "is_reload", "reload_schedule", "simulate_graph",
           "simulate_step"]


@dataclass
class LiveMemory:
    """Bytes of a simulated step: ``peak`` (above the inputs) and where it is (``peak_at``: a
    node name, with ``peak_phase`` ``forward`` or ``backward``), ``forward_peak``, ``saved``
    (held from the forward to the backward) and ``backward_peak`` (saved tensors included)."""

    peak: int
    peak_at: str
    peak_phase: str
    forward_peak: int
    saved: int
    backward_peak: int
    host: int = 0  # bytes in host memory between the forward and the backward (offloaded)
    stall_s: float = 0.0  # seconds the compute stream waits for copies back from the host


def _values(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


_WAIT = torch.ops._c10d_functional.wait_tensor.default
_HOST_OPS = ("autosp_lm::offload",)  # ops whose output is a host copy (compiler/offload.py)
_RELOAD_OPS = ("autosp_lm::reload",)  # ops that bring a host copy back to the device


def _is_host_copy(n: fx.Node) -> bool:
    return n.op == "call_function" and \
        getattr(getattr(n.target, "_schema", None), "name", None) in _HOST_OPS


def is_reload(n: fx.Node) -> bool:
    """``n`` brings an offloaded value back to the device (``autosp_lm::reload``)."""
    return n.op == "call_function" and \
        getattr(getattr(n.target, "_schema", None), "name", None) in _RELOAD_OPS


def reload_schedule(nodes: list, prefetch: int) -> dict:
    """Reload node -> the node at which its device tensor is allocated, as the offload ops of
    :mod:`autosp_lm.compiler.offload` run in a training step after the first: each
    ``autosp_lm::reload`` starts the copies of the next ``prefetch`` slots in the order the
    previous step reloaded them (this graph's order), so the ``k``-th reload's tensor is
    allocated at reload ``max(0, k - prefetch)`` (the first reload brings its own and the next
    ``prefetch``)."""
    reloads = [n for n in nodes if is_reload(n)]
    return {r: reloads[max(0, k - prefetch)] for k, r in enumerate(reloads)}


def _aliases(n: fx.Node) -> bool:
    """``n``'s value is (a view of) its first input's storage: a view op, or the wait of a
    functional collective (it returns the collective's output tensor itself, though its schema
    declares no alias)."""
    return is_alias_op(n) or (n.op == "call_function" and n.target is _WAIT)


def _is_part(n: fx.Node) -> bool:
    """``n`` takes one output of an op with several (``getitem`` of a tuple or list value) that
    owns its storage. The outputs of ``split``/``unbind``/``chunk`` are views of their input, not
    storages of their own: such a ``getitem`` is a view (its owner is the input's)."""
    return (n.op == "call_function" and n.target is operator.getitem and bool(n.args)
            and isinstance(n.args[0], fx.Node)
            and isinstance(n.args[0].meta.get("val"), (list, tuple))
            and not _aliases(n.args[0]))


_RNG_HOPS = ("run_and_save_rng_state", "run_with_rng_state")


def _rng_output(n: fx.Node) -> bool:
    """``n`` takes (through nested ``getitem``s) one tensor output of the op an activation
    checkpoint's RNG wrapper runs (``higher_order.run_and_save_rng_state`` in the forward,
    ``run_with_rng_state`` when the backward recomputes it, e.g. attention in a checkpointed
    block). The partitioner leaves those wrapper nodes without a value, so each such output is
    an allocation of its own, made where it is taken (right after the wrapper). The saved RNG
    state (a few KB; output 0 of ``run_and_save_rng_state``) is not counted."""
    if n.op != "call_function" or n.target is not operator.getitem \
            or not isinstance(n.meta.get("val"), torch.Tensor):
        return False
    first = n
    while isinstance(first.args[0], fx.Node) and first.args[0].target is operator.getitem:
        first = first.args[0]
    hop = first.args[0]
    name = getattr(getattr(hop, "target", None), "__name__", "")
    return (isinstance(hop, fx.Node) and hop.meta.get("val") is None and name in _RNG_HOPS
            and not (name == "run_and_save_rng_state" and first.args[1] == 0))


def storage_root(n: fx.Node) -> fx.Node:
    """The node that owns ``n``'s storage: through views to the op that allocated it; one
    output of a multi-output op (attention's output and its logsumexp) is its own owner, as
    each output is its own storage and dies on its own."""
    while n.op == "call_function" and not _is_part(n) and not _rng_output(n) \
            and (_aliases(n) or n.target is operator.getitem) \
            and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


@dataclass
class _Walk:
    """What :func:`simulate_graph` needs of a graph that does not depend on the sizes: the
    nodes in order with the values each allocates, and the storages freed after each."""

    steps: list  # (node, allocates (node is its own root, call_function), values counted, dead)
    frees: dict  # index -> roots freed after that node
    outputs: list  # (output index, root)
    # a multi-output op -> the positions in its value of the outputs that no getitem takes
    # (they die with the op); each taken output is owned by its getitem (a root of its own)
    untaken: dict = None
    dupes: set = None  # getitems of an output another getitem already owns
    early: dict = None  # index -> indices of the nodes whose outputs are allocated there
    moved: set = None  # indices of the nodes allocated earlier (prefetched reloads)
    source: dict = None  # index of an offload op -> the storage it copies to the host


def _walk(gm: fx.GraphModule, device: Optional[torch.device], prefetch: int = 0) -> _Walk:
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    out_node = nodes[-1] if nodes and nodes[-1].op == "output" else \
        next(n for n in nodes if n.op == "output")
    canon: dict = {}  # a second getitem of the same output -> the first (one owner)
    first: dict = {}
    for n in nodes:
        if _is_part(n):
            canon[n] = first.setdefault((n.args[0], n.args[1]), n)

    def owner(a):
        r = storage_root(a)
        return canon.get(r, r)

    outs = flat_outputs(gm.graph)
    kept = {owner(o) for o in outs if isinstance(o, fx.Node)}
    last: dict = {}  # root -> index of its last reader
    for n in nodes:
        for a in n.all_input_nodes:
            r = owner(a)
            last[r] = max(last.get(r, -1), order[n])
    taken: dict = {}  # multi-output op -> positions of its outputs that a getitem takes
    for n in nodes:
        if _is_part(n) and isinstance(n.args[1], int) and canon[n] is n:
            if n in last or n in kept:
                taken.setdefault(n.args[0], set()).add(n.args[1])
            else:
                last[n] = order[n]  # read by nothing: dies where it is taken
    frees: dict = {}
    for r, i in last.items():
        if r not in kept:
            frees.setdefault(i, []).append(r)
    steps, untaken = [], {}
    for n in nodes:
        alloc = n.op == "call_function" and storage_root(n) is n and not _is_part(n)
        vals = [t for t in _values(n.meta.get("val"))
                if device is None or t.device.type == device.type] \
            if alloc and not _is_host_copy(n) else []
        if alloc and isinstance(n.meta.get("val"), (list, tuple)) and n not in kept:
            untaken[n] = [i for i, v in enumerate(n.meta["val"])
                          if isinstance(v, torch.Tensor) and i not in taken.get(n, ())
                          and (device is None or v.device.type == device.type)]
        steps.append((n, alloc, vals, alloc and n is not out_node and not n.users))
    # ... and getitems of an op whose whole value is an output: the op keeps all of it
    dupes = {n for n, c in canon.items() if c is not n or n.args[0] in kept}
    early: dict = {}
    for r, at in reload_schedule(nodes, prefetch).items():
        if at is not r:
            early.setdefault(order[at], []).append(order[r])
    moved = {i for v in early.values() for i in v}
    source = {order[n]: owner(n.args[0]) for n in nodes
              if _is_host_copy(n) and n.args and isinstance(n.args[0], fx.Node)}
    return _Walk(steps, frees, [(i, owner(o)) for i, o in enumerate(outs)
                                if isinstance(o, fx.Node)], untaken, dupes, early, moved,
                 source)


class Clock:
    """The two CUDA streams of a step with activation offload, in seconds: the compute stream
    runs the graphs' nodes one after the other (``seconds(node)``: the cost model's price at the
    simulated length), the offload ops' side stream runs their copies one after the other at
    ``host_bw`` bytes/s (:mod:`autosp_lm.compiler.offload`: one side stream per device).

    * ``offload(x)``: the copy starts when ``x`` is made and the side stream is free; ``x``'s
      device memory returns to the allocator when both its last reader has run and the copy
      has ended (``record_stream``: the caching allocator waits for the side stream);
    * ``reload``: the tensor is allocated when the reload that prefetches it runs
      (:func:`reload_schedule`), its copy starts then (or when the side stream is free), and
      the reload waits for it: ``stall`` sums those waits.

    One clock runs through a step's forward and backward (the forward's copies may still run
    when the backward starts)."""

    def __init__(self, seconds: Callable, host_bw: float):
        self.seconds, self.host_bw = seconds, host_bw
        self.t = self.side = self.stall = 0.0
        self.pending: list = []  # (time its copy ends, bytes): device memory held by a copy
        self.ready: dict = {}  # reload node -> time its copy back ends

    def copy(self, nbytes: int) -> float:
        """Queue a copy of ``nbytes`` on the side stream now; the time it ends."""
        self.side = max(self.t, self.side) + nbytes / self.host_bw
        return self.side

    def release(self) -> int:
        """Bytes whose copies have ended by now (dropped from ``pending``)."""
        done = sum(b for end, b in self.pending if end <= self.t)
        self.pending = [(end, b) for end, b in self.pending if end > self.t]
        return done

    def held(self) -> int:
        return sum(b for _, b in self.pending)


def simulate_graph(gm: fx.GraphModule, *, live_inputs: Optional[dict] = None,
                   device: Optional[torch.device] = None,
                   size_of: Callable = tensor_bytes,
                   inner_peak: Optional[Callable] = None,
                   walks: Optional[dict] = None,
                   prefetch: Optional[int] = None,
                   clock: Optional[Clock] = None,
                   record: Optional[list] = None) -> tuple[int, str, int, dict]:
    """Simulate one graph. ``live_inputs``: placeholder name -> bytes of the inputs that count
    (live at the start, freed after their last use). ``inner_peak(node)``: for an op whose
    implementation allocates more than its outputs (an opaque custom op), the peak bytes it
    allocates while it runs, outputs included (None: its outputs). ``walks``: a dict kept
    between calls on unchanged graphs (the size-independent analysis is made once; the memory
    planner evaluates one graph at many lengths). ``prefetch``:
    the offload ops' reload prefetch depth (:func:`reload_schedule`; the trainer's
    :data:`~autosp_lm.compiler.offload.PREFETCH`, read at the call). ``clock``: the streams'
    times on CUDA
    (:class:`Clock`; the device memory its copies still hold when the graph starts is live
    too); None: copies are synchronous (CPU). ``record``: a list to append (node name, bytes
    live after it) to, node by node (to see where memory goes). Returns (peak, node at the
    peak, bytes live at the end, {output index: bytes} of the outputs' storages)."""
    live_inputs = live_inputs or {}
    prefetch = offload_ops.PREFETCH if prefetch is None else prefetch  # read now: one constant
    key = (id(gm), device.type if device is not None else None, prefetch)
    walk = walks.get(key) if walks is not None else None
    if walk is None or walk.steps[0][0].graph is not gm.graph:
        walk = _walk(gm, device, prefetch)
        if walks is not None:
            walks[key] = walk
    size: dict = {}
    live = peak = 0
    peak_at = ""
    frees = walk.frees
    steps = walk.steps
    held: dict = {}  # (clock) offloaded value -> the time its copy to the host ends
    if clock is not None:
        live = clock.held()
    for i, (n, alloc, vals, dead) in enumerate(steps):
        if clock is not None:
            live -= clock.release()
        if n.op == "placeholder":
            size[n] = live_inputs.get(n.name, 0)
            live += size[n]
        elif alloc and i not in walk.moved:
            size[n] = sum(size_of(t) for t in vals)
            inner = inner_peak(n) if inner_peak is not None else None
            if inner is not None and live + inner > peak:
                peak, peak_at = live + inner, n.name
            live += size[n]
            if clock is not None and is_reload(n):
                clock.ready[n] = clock.copy(size[n])
        elif _is_part(n):  # one output of the op before it: counted there, owned here
            v = n.args[0].meta["val"][n.args[1]] \
                if isinstance(n.args[1], int) and n not in walk.dupes else None
            size[n] = size_of(v) if isinstance(v, torch.Tensor) and (
                device is None or v.device.type == device.type) else 0
        for j in walk.early.get(i, ()):  # reloads this reload prefetches: allocated (and their
            m = steps[j][0]  # copies queued) here, after its own
            size[m] = sum(size_of(t) for t in steps[j][2])
            live += size[m]
            if clock is not None:
                clock.ready[m] = clock.copy(size[m])
            if live > peak:
                peak, peak_at = live, f"{n.name} (prefetching {m.name})"
        if clock is not None:
            if is_reload(n):  # the compute stream waits for the copy back
                wait = clock.ready.pop(n, clock.t) - clock.t
                if wait > 0:
                    clock.stall += wait
                    clock.t += wait
            elif _is_host_copy(n):  # the copy to the host starts: its source is held till then
                src = walk.source.get(i)
                if src is not None:
                    held[src] = clock.copy(size.get(src, 0))
            else:
                clock.t += clock.seconds(n)
        if live > peak:
            peak, peak_at = live, n.name
        if n in walk.untaken:  # outputs no getitem takes die with the op; the rest are owned
            vals_n = n.meta["val"]  # by their getitems
            live -= sum(size_of(vals_n[j]) for j in walk.untaken[n])
            size[n] = 0
        for r in frees.get(i, ()):
            if clock is not None and held.get(r, 0.0) > clock.t:  # its copy is still running
                clock.pending.append((held[r], size.get(r, 0)))
                continue
            live -= size.get(r, 0)
        if dead:
            live -= size.get(n, 0)  # dead value
        if record is not None:
            record.append((n.name, live))
    outs = {i: size.get(r, 0) for i, r in walk.outputs}
    return peak, peak_at, live, outs


def _saved_inputs(phs: list, saved_nodes: list) -> dict:
    """Backward placeholder -> index in ``saved_nodes`` of the forward output it receives. The
    partitioner names them alike; it also orders them differently (the forward returns saved
    tensors then symbolic sizes, the backward takes the sizes first), so match by name, and by
    position only where the names do not match (an older partitioner)."""
    names = {o.name: i for i, o in enumerate(saved_nodes) if isinstance(o, fx.Node)}
    by_name = {ph: names[ph.name] for ph in phs if ph.name in names}
    if len(by_name) == len(saved_nodes):
        return by_name
    if by_name:  # a few renamed (a checkpoint's RNG states: rng_state_output_<k>), in order
        rest = [i for i in range(len(saved_nodes)) if i not in set(by_name.values())]
        rest_phs = [ph for ph in phs if ph not in by_name and not ph.name.startswith("tangents")]
        if len(rest) == len(rest_phs):
            return {**by_name, **dict(zip(rest_phs, rest))}
    return {ph: i for i, ph in enumerate(phs[:len(saved_nodes)])}


def simulate_step(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, *,
                  device: Optional[torch.device] = None,
                  size_of: Callable = tensor_bytes,
                  inner_peak: Optional[Callable] = None,
                  walks: Optional[dict] = None, prefetch: Optional[int] = None,
                  clock: Optional["Clock"] = None) -> LiveMemory:
    """The forward then the backward of one partitioned step (``num_fwd_outputs``: the user's
    outputs of ``fw``; the rest are saved for ``bw``, whose placeholders take them in order
    before the tangents). ``device``: the step's device (default: that of the first saved
    tensor); tensors elsewhere are not counted. ``size_of`` / ``inner_peak``: as in
    :func:`simulate_graph`, ``walks`` too. ``LiveMemory.host``: the bytes of the offload ops'
    host copies (AutoSP's ``--offload-activations``, the recipes' compiled ``--cpu-offloading``).
    ``prefetch``: how many slots ahead the reloads bring their tensors back
    (:func:`reload_schedule`; default the trainer's
    :data:`~autosp_lm.compiler.offload.PREFETCH`, the one constant both read). ``clock``: a
    CUDA step's two streams (:class:`Clock`): the offloaded values' device memory is freed when
    their copy to the host has ended, not before (stream-ordered frees), and the step's wait for
    the copies back is ``LiveMemory.stall_s``; None: the copies are synchronous (CPU)."""
    outs = flat_outputs(fw.graph)
    saved_nodes = outs[num_fwd_outputs:]
    if device is None:
        device = next((v.device for o in saved_nodes if isinstance(o, fx.Node)
                       for v in _values(o.meta.get("val"))), None)
    f_peak, f_at, f_end, f_outs = simulate_graph(
        fw, device=device, size_of=size_of, inner_peak=inner_peak, walks=walks,
        prefetch=prefetch, clock=clock)
    # the backward's inputs: the saved values (storages shared between them counted once,
    # as in the forward) and the tangents
    phs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    live_inputs, seen, host = {}, set(), 0
    for ph, i in _saved_inputs(phs, saved_nodes).items():
        o = saved_nodes[i]
        r = storage_root(o) if isinstance(o, fx.Node) else None
        if r is None or r.op == "placeholder" or r in seen:
            continue
        seen.add(r)
        if _is_host_copy(r):  # offloaded: the backward reloads it (a node of its own)
            host += size_of(r.meta["val"])
        else:
            live_inputs[ph.name] = f_outs.get(num_fwd_outputs + i, 0)
    saved_phs = set(_saved_inputs(phs, saved_nodes))
    for ph in phs:
        if ph not in saved_phs:  # the tangents
            live_inputs[ph.name] = sum(size_of(t) for t in _values(ph.meta.get("val"))
                                       if device is None or t.device.type == device.type)
    saved = sum(v for k, v in live_inputs.items() if k in {p.name for p in saved_phs})
    user_outs = sum(f_outs.get(i, 0) for i in range(num_fwd_outputs))
    b_peak, b_at, _, _ = simulate_graph(bw, live_inputs=live_inputs, device=device,
                                        size_of=size_of, inner_peak=inner_peak, walks=walks,
                                        prefetch=prefetch, clock=clock)
    b_total = b_peak + user_outs
    stall = clock.stall if clock is not None else 0.0
    if f_peak >= b_total:
        return LiveMemory(f_peak, f_at, "forward", f_peak, saved, b_peak, host, stall)
    return LiveMemory(b_total, b_at, "backward", f_peak, saved, b_peak, host, stall)
