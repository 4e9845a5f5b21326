"""The collective schedule of a compiled step, and the compile-time check that every rank of the
sequence-parallel group runs the same one.

Why
    A compile-time decision that adds, removes or reorders a collective (SAC's re-communication,
    tiling, offload, a fallback, the plan) and comes out differently on one rank is a hang: that
    rank waits in one collective while the others wait in another. Decisions are derived from
    rank-independent facts (a rank's shard shapes are the same on every rank; size queries and
    symbolic-size arithmetic, which differ with a rank's bounds, are ignored by the cost model),
    and this check makes the guarantee hold by construction: a difference is an
    :class:`~autosp_lm.compiler.graph.AutoSPError` before the first step, never a hang.

What is compared
    :func:`collective_schedule`: after the joint graph is partitioned, the collectives of the
    forward graph and of the backward graph in graph order, each as a rank-independent record:
    its kind (``all_gather``, ``reduce_scatter``, ``ring_attention`` ...), its group described by
    size and rank stride (not by name: the Ulysses groups of a U x R plan have different names on
    different ranks), the dtype and shape of its first tensor input at the traced sizes, and its
    other non-tensor arguments (dims, halo widths, world). :func:`schedule_hash` hashes it.

How the ranks compare (:func:`agree`)
    Through the default process group's key-value store, never through a collective of the SP
    group: a store read has a timeout, so the check itself cannot hang. Every rank publishes its
    schedule under the graph's key (:func:`mark_compiling`: the signature, a hash of the Dynamo
    graph and its input sizes, which are the same on every rank, and how many times this process
    compiled that signature for the group before) and waits for the other ranks' entries of the
    same key:

    * at a first compile every rank compiles (the first call happens on every rank), so all
      entries arrive; the wait is bounded by ``timeout`` (default 1800 s, the default process
      group timeout), after which the ranks that never published are named in an AutoSPError;
    * at a recompile on one rank only (a guard that failed there), the other ranks publish no
      entry of this key. A rank that is not compiling the same graph (its
      ``compiling`` marker says another one) after ``grace`` seconds (default 30) is compared by
      the schedule it runs now (its latest entry) without shapes (a recompile for a new length
      changes shapes, not the order of collectives); equal: the compile goes on and the report
      says so; different: an AutoSPError (it would hang).

    A mismatch raises on every rank that sees it, naming the first differing collective: its
    position, forward or backward, and what each rank has there.

    Assumption: the ranks compile the same graphs for the group in the same order (the
    ``autosp_compile``-d model called at the same point of the program on every rank, as with
    any collective); a graph compiled on some ranks only does not disturb the keys of others.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from .graph import AutoSPError, example, is_collective_op, namespace, schema_name

#: ``autosp_lm::`` ops that communicate inside (beyond :data:`AUTOSP_COLLECTIVES`)
COMMUNICATING_OPS = frozenset({"ring_attention", "ring_attention_backward"})
#: functional-collective bookkeeping ops that move no data
_NOT_COMMUNICATION = frozenset({"wait_tensor"})
DEFAULT_TIMEOUT = 1800.0
DEFAULT_GRACE = 30.0
_POLL = 0.05
_OCCURRENCES: dict = {}  # (namespace, signature) -> compiles in this process


def communicates(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    if namespace(t) == "autosp_lm" and schema_name(t) in COMMUNICATING_OPS:
        return True
    return is_collective_op(t) and schema_name(t) not in _NOT_COMMUNICATION


def _hint(s: Any) -> Any:
    from .passes.sac_cost import hint
    return hint(s)


def _group_text(name: str) -> str:
    """A group by its size and rank stride (``4 ranks``, ``2 ranks stride 2``)."""
    import torch.distributed as dist
    try:
        from autosp_lm.parallel.collectives import resolve_group
        ranks = dist.get_process_group_ranks(resolve_group(name))
    except Exception:  # noqa: BLE001 - not a registered group here (a world of one)
        return "?"
    ranks = sorted(ranks)
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    text = f"{len(ranks)} ranks"
    if len(steps) == 1 and steps != {1}:
        text += f" stride {steps.pop()}"
    elif len(steps) > 1:
        text += " irregular"
    return text


def _arg_text(a: Any) -> Any:
    if isinstance(a, (bool, int, float, str)) or a is None:
        return a
    if isinstance(a, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in a):
        return list(a)
    return None


def describe_collective(node: fx.Node) -> dict:
    """The rank-independent record of one communicating node."""
    t = node.target
    schema = getattr(t, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    rec: dict = {"op": schema_name(t)}
    tensor = None
    args: dict = {}
    for key, a in bound.items():
        if isinstance(a, fx.Node):
            if tensor is None and isinstance(example(a), torch.Tensor):
                tensor = example(a)
            continue
        if key in ("group", "group_name") and isinstance(a, str):
            rec["group"] = _group_text(a)
            continue
        if key == "tag":  # functional collectives' legacy tag: a label, not a group
            continue
        text = _arg_text(a)
        if text is not None:
            args[key] = text
    if tensor is not None:
        rec["dtype"] = str(tensor.dtype).replace("torch.", "")
        rec["shape"] = [_hint(s) for s in tensor.shape]
    if args:
        rec["args"] = args
    return rec


def collective_schedule(forward: Optional[fx.GraphModule],
                        backward: Optional[fx.GraphModule] = None) -> dict:
    """``{"forward": [record, ...], "backward": [...]}``: the communicating nodes in graph order."""
    out = {}
    for phase, gm in (("forward", forward), ("backward", backward)):
        nodes = gm.graph.nodes if gm is not None else ()
        out[phase] = [describe_collective(n) for n in nodes if communicates(n)]
    return out


def _canonical(schedule: dict, shapes: bool = True) -> str:
    if not shapes:
        schedule = {p: [{k: v for k, v in r.items() if k != "shape"} for r in recs]
                    for p, recs in schedule.items()}
    return json.dumps(schedule, sort_keys=True, separators=(",", ":"))


def schedule_hash(schedule: dict, shapes: bool = True) -> str:
    return hashlib.sha256(_canonical(schedule, shapes).encode()).hexdigest()[:16]


def record_text(rec: Optional[dict]) -> str:
    if rec is None:
        return "nothing (its schedule ends before)"
    parts = [rec.get("group", "")] if rec.get("group") else []
    if "dtype" in rec:
        parts.append(f"{rec['dtype']}{rec.get('shape', '')}")
    parts += [f"{k}={v}" for k, v in sorted(rec.get("args", {}).items())]
    return f"{rec['op']}({', '.join(parts)})"


def first_difference(a: dict, b: dict, shapes: bool = True) -> Optional[tuple]:
    """``(phase, position, record of a, record of b)`` of the first collective where the
    schedules differ (a record is None where one schedule has ended), or None."""
    for phase in ("forward", "backward"):
        xs, ys = a.get(phase, []), b.get(phase, [])
        for i in range(max(len(xs), len(ys))):
            x = xs[i] if i < len(xs) else None
            y = ys[i] if i < len(ys) else None
            if not shapes:
                x = None if x is None else {k: v for k, v in x.items() if k != "shape"}
                y = None if y is None else {k: v for k, v in y.items() if k != "shape"}
            if x != y:
                return phase, i, x, y
    return None


def mismatch_error(mine: dict, rank: int, theirs: dict, other: int, shapes: bool = True,
                   alone: bool = False) -> AutoSPError:
    phase, i, x, y = first_difference(mine, theirs, shapes)
    why = (" (this rank recompiled alone: a guard failed here only; compared with the schedule "
           f"rank {other} runs now)" if alone else "")
    return AutoSPError(
        f"AutoSP: the ranks of the sequence-parallel group would run different collectives, a "
        f"hang at the first step{why}. First difference: {phase} collective #{i + 1}: rank "
        f"{rank} runs {record_text(x)}, rank {other} runs {record_text(y)} (schedule hashes "
        f"{schedule_hash(mine, shapes)} vs {schedule_hash(theirs, shapes)}). A compile-time "
        f"decision came out differently on these ranks: make every rank compile with the same "
        f"options (--sac-device, memory target, tiling) and report the model; "
        f"sac_recommunicate=False (--no-sac-recommunicate) removes SAC's re-communication")


def graph_signature(gm: fx.GraphModule, example_inputs) -> str:
    """The same on every rank for the same Dynamo graph: its code and its inputs' sizes."""
    parts = [gm.code]
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"{x.dtype}{tuple(str(s) for s in x.shape)}")
        else:
            parts.append(type(x).__name__)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]




@dataclass
class Agreement:
    """What :func:`agree` found (for the report)."""

    hash: str
    forward: int
    backward: int
    ranks: int
    how: str  # "all ranks" | "alone" (compared with what the other ranks run) | "unchecked"
    alone_with: list = field(default_factory=list)


def default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except Exception:  # noqa: BLE001 - no store (a world of one, or an unusual init)
        return None


def _namespace(group) -> str:
    from autosp_lm.parallel.collectives import group_name
    return f"autosp/schedule/{group_name(group)}"


def shared(group) -> bool:
    """A real group of several ranks (not a simulated world: the ``fake`` backend of
    ``init_simulated_world`` has one process and no store to meet in)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1 \
        and dist.get_backend(group) != "fake"


def agree(schedule: dict, group, *, key: str, first: bool,
          timeout: float = DEFAULT_TIMEOUT, grace: float = DEFAULT_GRACE,
          store=None) -> Agreement:
    """Compare ``schedule`` with the other ranks of ``group`` (module docstring); raises
    :class:`AutoSPError` on a difference or when a rank never publishes within ``timeout``."""
    import torch.distributed as dist
    if not shared(group):
        return Agreement(ranks=1, how="unchecked", hash=schedule_hash(schedule),
                         forward=len(schedule["forward"]), backward=len(schedule["backward"]))
    store = store if store is not None else default_store()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return exchange(store, _namespace(group), dist.get_rank(), ranks, schedule, key,
                    first=first, timeout=timeout, grace=grace)


def exchange(store, ns: str, me: int, ranks: list, schedule: dict, key: str, *,
             first: bool, timeout: float, grace: float) -> Agreement:
    """:func:`agree` over a key-value ``store`` under ``ns`` for the graph ``key``: ``me`` and
    ``ranks`` are global ranks (an AutoSPError names ranks of the group: their index in
    ``ranks``)."""
    h = schedule_hash(schedule)
    counts = dict(hash=h, forward=len(schedule["forward"]), backward=len(schedule["backward"]))
    text = _canonical(schedule)
    try:
        store.set(f"{ns}/{key}/{me}", text)
        store.set(f"{ns}/latest/{me}", text)
    except Exception:  # noqa: BLE001 - no store, or one without set: nothing to meet in
        return Agreement(ranks=len(ranks), how="unchecked", **counts)
    peers = [r for r in ranks if r != me]
    start = time.monotonic()
    got: dict = {}
    alone: list = []
    while True:
        waited = time.monotonic() - start
        for r in peers:
            if r in got or r in alone:
                continue
            entry = f"{ns}/{key}/{r}"
            if store.check([entry]):
                got[r] = json.loads(store.get(entry))
            elif not first and waited > grace and _compiling_other(store, ns, r, key):
                alone.append(r)
        if len(got) + len(alone) == len(peers):
            break
        if waited > timeout:
            missing = [ranks.index(r) for r in peers if r not in got and r not in alone]
            raise AutoSPError(
                f"AutoSP: ranks {missing} of the sequence-parallel group did not compile the "
                f"same graph within {timeout:.0f} s of rank {ranks.index(me)}, so the ranks "
                f"cannot check that they run the same collectives. Every rank must call the "
                f"compiled model at the same point, with the same batch shapes")
        time.sleep(_POLL)
    for r in sorted(got):
        if schedule_hash(got[r]) != h:
            raise mismatch_error(schedule, ranks.index(me), got[r], ranks.index(r))
    for r in sorted(alone):
        theirs = json.loads(store.get(f"{ns}/latest/{r}"))
        if schedule_hash(theirs, shapes=False) != schedule_hash(schedule, shapes=False):
            raise mismatch_error(schedule, ranks.index(me), theirs, ranks.index(r),
                                 shapes=False, alone=True)
    return Agreement(ranks=len(ranks), how="alone" if alone else "all ranks",
                     alone_with=[ranks.index(r) for r in alone], **counts)


def _compiling_other(store, ns: str, rank: int, key: str) -> bool:
    """``rank`` compiles (or last compiled) another graph and runs a schedule it published."""
    marker, latest = f"{ns}/compiling/{rank}", f"{ns}/latest/{rank}"
    return store.check([marker, latest]) and store.get(marker).decode() != key


def mark_compiling(group, signature: str, store=None) -> str:
    """The key of the graph this rank compiles now for ``group`` (``signature.occurrence``); the
    other ranks are told through the store that this rank compiles it (:func:`exchange`'s
    recompile case)."""
    import torch.distributed as dist
    if not shared(group):
        return signature
    ns = _namespace(group)
    occurrence = _OCCURRENCES.get((ns, signature), 0)
    _OCCURRENCES[(ns, signature)] = occurrence + 1
    key = f"{signature}.{occurrence}"
    store = store if store is not None else default_store()
    try:
        store.set(f"{ns}/compiling/{dist.get_rank()}", key)
    except Exception:  # noqa: BLE001 - see exchange()
        pass
    return key
