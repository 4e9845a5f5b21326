"""The memory plan AutoSP chooses when it compiles: the fastest plan predicted to fit the budget.

With ``AutoSPOptions.memory_budget`` (bytes a rank may use) and ``memory_predictor`` (the memory
planner's model of the step: :func:`autosp_lm.planner.fit.step_predictor`, handed in by the
entry point, since the compiler may not import the planner), the partitioner of each compiled
graph evaluates the candidate plans on copies of its joint graph: the joint passes with the
candidate's options, the min-cut partition, activation offload where the candidate has it, then
the planner's liveness simulation and cost model on the partitioned graphs at the batch's real
length, parameters, gradients, optimizer states and FSDP units included. The fastest candidate
whose predicted peak fits is compiled.

Two rounds, because a candidate that changes the sharded graph (attention head groups, which the
max-context mode uses too) needs the graph passes run again, which costs a second AOTAutograd
trace:

1. on the graph as sharded: SAC recomputing nothing (``sac-keep-all``, the fastest plan, taken
   at once when it fits: the common case costs one prediction); then the default SAC plan
   (``sac``) and SAC with a memory target sized to the budget (``sac-target``); then, if
   neither fits, activation offload (``offload``);
2. only when nothing of round 1 fits, on the graph sharded in the most head groups:
   ``head-groups``; then ``max-context``; then ``max-context-offload``.

A later candidate recomputes or moves more than an earlier one, so it is evaluated only when none
before it fits (:data:`ROUNDS`); among the fitting plans evaluated, the predicted step times
decide. When nothing fits, the compile stops before any step with
one line: the longest length that fits this budget, and what would fit the requested one.

Ranks agree: the first rank of the SP group chooses and publishes its choice (or its error)
through the default store (as :mod:`.schedule` does); the others wait for it and compile that
plan without evaluating. Explicit plan flags win: with ``choose_plan=False`` only the options as
given are predicted and reported (a plan over the budget is then a note, not an error).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.fx as fx

from .graph import AutoSPError

MiB = 2 ** 20
_POLL = 0.05


@dataclass
class PlanPrediction:
    """What the memory planner predicts of one candidate's partitioned graphs (bytes per rank)."""

    peak: int
    step_s: float
    host: int = 0  # offloaded activations in host memory
    static: int = 0  # what no plan changes: parameters, optimizer states, the batch
    # the longest global sequence length (at most ``cap``) whose predicted peak fits ``budget``
    longest: Optional[Callable[[int, int], int]] = field(default=None, repr=False)


@dataclass(frozen=True)
class Candidate:
    name: str
    changes: tuple  # (AutoSPOptions field, value) pairs
    flags: str  # the pretrain.py flags that run it


#: the rounds, each a list of groups of candidates in the order of their expected step time: a
#: group is evaluated only when no plan of the groups before it fits (a later group's plans
#: recompute or move more than an earlier one's: SAC with the default budget or a memory target
#: before offload; head groups before the max-context mode, which recomputes every layer, before
#: its offload); among the fitting plans of the groups evaluated the fastest prediction wins
KEEP_ALL = float(2 ** 62)  # a memory target no plan reaches: SAC recomputes nothing

ROUNDS = (
    ((Candidate("sac-keep-all", (("sac_memory_target", KEEP_ALL),),
                "--sac-memory-target-gb {target_gb}"),),
     (Candidate("sac", (), "--autosp"),
      Candidate("sac-target", (), "--sac-memory-target-gb {target_gb}")),
     (Candidate("offload", (("offload_activations", True),), "--offload-activations"),)),
    ((Candidate("head-groups", (("attention_head_groups", 0),), "--attention-head-groups 0"),),
     (Candidate("max-context", (("max_context", True), ("attention_head_groups", 0)),
                "--max-context"),),
     (Candidate("max-context-offload", (("max_context", True), ("attention_head_groups", 0),
                                        ("offload_activations", True)),
                "--max-context --offload-activations"),)),
)
_TARGET_TRIES = 3  # a memory target sized to the budget, corrected by what the peak missed


@dataclass
class Row:
    name: str
    flags: str
    peak: Optional[int] = None
    step_s: Optional[float] = None
    host: int = 0
    fits: bool = False
    why_not: str = ""  # the candidate does not apply (its trial failed)
    saved: Optional[int] = None  # SAC's saved bytes of the plan (sizes a memory target)
    changes: dict = field(default_factory=dict)
    prediction: Any = field(default=None, repr=False, compare=False)
    result: Any = field(default=None, repr=False, compare=False)  # (fw, bw, trial context)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "flags", "peak", "step_s", "host", "fits",
                                               "why_not", "changes", "saved")}


class NoPlanFits(AutoSPError):
    """No candidate plan is predicted to fit the budget; ``candidates``: every candidate's row
    (name, flags, predicted peak and step, why it does not apply)."""

    def __init__(self, message: str, candidates: list):
        super().__init__(message)
        self.candidates = candidates


class NextRound(Exception):
    """Nothing of this round fits: compile the graph again with round ``n + 1``'s sharding."""

    def __init__(self, round_index: int):
        super().__init__(f"memory plan: round {round_index + 1}")
        self.round_index = round_index


@dataclass
class Chooser:
    """The choice for one compiled graph (:mod:`this module <.memory_plan>`); lives across its
    rounds. ``publish``: called with the decision (a JSON-able dict) or an error line."""

    budget: int
    predictor: Callable
    requested: int = 0  # the batch's sequence length (filled from the plan's traced length)
    round_index: int = 0
    fixed: bool = False  # explicit flags: predict and report the given options only
    rows: list = field(default_factory=list)
    publish: Callable = lambda decision: None
    decision: Optional[dict] = None
    seconds: float = 0.0
    world: int = 1  # the SP group's size (what a longer sequence would need is counted in it)

    def round_options(self, base):
        """The options of this round's graph passes (round 2: the most head groups)."""
        if self.round_index == 0 or self.fixed:
            return base
        return dataclasses.replace(base, attention_head_groups=0)

    # -- in the partitioner ---------------------------------------------------------------------
    def choose(self, joint: fx.GraphModule, joint_inputs, kwargs: dict, passes: list, ctx):
        """Choose the plan of this compiled graph and return its partition ``(fw, bw)``: the
        chosen trial's, its context's results (SAC statistics, report fields, schedule) moved
        into ``ctx``, whose options become the chosen ones. Raises :class:`NextRound` when
        nothing of this round fits and a round is left, else an AutoSPError (published first);
        None: the explicit plan could not be predicted, the caller runs the per-plan passes
        (the others have run) and partitions as usual."""
        from .aot import run_passes
        t0 = time.perf_counter()
        self.requested = self.requested or int(ctx.report.plan.get("traced_length") or 0)
        self.world = ctx.world
        try:
            # the passes every candidate runs alike: once, on the joint graph the trials copy
            joint._num_fwd_outputs = kwargs["num_fwd_outputs"]
            run_passes([p for p in passes if not getattr(p, "per_plan", False)], joint, ctx)
            passes = [p for p in passes if getattr(p, "per_plan", False)]
            if self.fixed:
                row = self._trial(Candidate("as given", (), "(the flags given)"), joint,
                                  joint_inputs, kwargs, passes, ctx)
                self.rows.append(row)
                return self._decide(row, ctx, t0)
            rows = []
            for group in ROUNDS[self.round_index]:
                for cand in group:
                    if cand.name == "sac-target":
                        base = next(r for r in rows if r.name == "sac")
                        rows += self._target(joint, joint_inputs, kwargs, passes, ctx, base)
                    else:  # an offload plan that offloads nothing is the plan before it
                        rows.append(self._trial(cand, joint, joint_inputs, kwargs, passes, ctx,
                                                same_as=_without_offload(rows, cand)))
                    static = rows[0].prediction.static if rows[0].prediction is not None else 0
                    if static > self.budget:  # the model state alone is over: no plan fits
                        self.rows += rows
                        self._refuse(self.nothing_fits(static=static))
                fits = [r for r in rows if r.fits]
                if fits:
                    self.rows += rows
                    return self._decide(min(fits, key=lambda r: r.step_s), ctx, t0)
            self.rows += rows
            if self.round_index + 1 < len(ROUNDS):
                raise NextRound(self.round_index)
            self._refuse(self.nothing_fits())
        except (NextRound, AutoSPError):
            self.seconds += time.perf_counter() - t0
            raise
        except Exception as e:  # the other ranks wait for a decision: tell them it failed
            self.publish({"error": f"AutoSP: the memory-plan choice failed on the first rank of "
                                   f"the group ({type(e).__name__}: {e})"})
            raise

    def _refuse(self, error: str):
        candidates = [r.as_dict() for r in self.rows]
        self.publish({"error": error, "candidates": candidates})
        raise NoPlanFits(error, candidates)

    def _decide(self, row: Row, ctx, t0: float):
        self.seconds += time.perf_counter() - t0
        if row.result is None:  # the plan given could not be predicted: compiled as given
            self.decision = dict(name=row.name, flags=row.flags, peak=None, step_s=None,
                                 fits=None, budget=self.budget, changes={}, fixed=True,
                                 why_not=row.why_not, seconds=round(self.seconds, 3))
            self.publish(self.decision)
            return None
        fw, bw, sub = row.result
        ctx.options, ctx.sac_stats[:], ctx.schedule = sub.options, sub.sac_stats, sub.schedule
        ctx.report.fsdp = sub.report.fsdp  # after_partition's figures of the chosen partition
        # the runner-up: the next slower plan predicted, else the nearest faster one (which then
        # does not fit); a row standing for another plan (nothing to offload) is not a plan
        ranked = sorted((r for r in self.rows if r.peak is not None and r is not row
                         and not r.why_not), key=lambda r: r.step_s)
        nxt = next((r for r in ranked if r.step_s >= row.step_s), ranked[-1] if ranked else None)
        self.decision = dict(name=row.name, flags=row.flags, peak=row.peak, step_s=row.step_s,
                             static=row.prediction.static,
                             host=row.host, fits=row.fits, budget=self.budget,
                             changes=row.changes, round=self.round_index + 1,
                             next=nxt.as_dict() if nxt else None, fixed=self.fixed,
                             seconds=round(self.seconds, 3),
                             candidates=[r.as_dict() for r in self.rows])
        self.publish(self.decision)
        return fw, bw

    def _trial(self, cand: Candidate, joint, joint_inputs, kwargs, passes, ctx,
               extra: Optional[dict] = None, same_as: Optional[Row] = None) -> Row:
        """One candidate on a copy of the joint graph: its joint passes, the min-cut partition,
        :func:`~.aot.after_partition` (offload, the schedule), then the prediction. The row keeps
        the partition and the trial's context: the chosen one is the compiled partition.
        ``same_as``: a row whose plan this one equals if its SAC pass offloads nothing (then
        that row's partition and prediction stand for it)."""
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from .aot import after_partition, run_passes
        from .partition import opaque_after_rng_states
        from .report import Report

        changes = dict(cand.changes, **(extra or {}))
        row = Row(cand.name, cand.flags, changes=changes)
        options = dataclasses.replace(ctx.options, **changes)
        n = kwargs["num_fwd_outputs"]
        from torch.fx._lazy_graph_module import _LazyGraphModule
        with warnings.catch_warnings():  # torch's pytree specs warn when deep-copied
            warnings.simplefilter("ignore", FutureWarning)
            # lazy: no Python code generated for a graph only partitioned (0.4 s a copy)
            trial = _LazyGraphModule(joint, copy.deepcopy(joint.graph))
        trial._num_fwd_outputs = n
        sub = dataclasses.replace(ctx, options=options, report=Report(world=ctx.world),
                                  sac_stats=[], partitions=[], schedule=None, chooser=None)
        sub.report.fsdp = copy.copy(ctx.report.fsdp)  # tag_param_gathers' figures (shared)
        try:
            run_passes(passes, trial, sub)
            stats = sub.sac_stats[-1] if sub.sac_stats else {}
            if same_as is not None and same_as.peak is not None and not stats.get("offloaded_bytes"):
                row.peak, row.step_s, row.saved = same_as.peak, same_as.step_s, same_as.saved
                row.why_not = f"the same plan as {same_as.name} here (nothing to offload)"
                # fits stays False: not a plan of its own, never chosen over the one it equals
                return row
            fw, bw = min_cut_rematerialization_partition(trial, joint_inputs, **kwargs)
            opaque_after_rng_states(fw, bw, n)
            after_partition(fw, bw, n, sub)
            pred = self.predictor([(fw, bw, n)], dict(ctx.report.plan))
        except (AutoSPError, ValueError, RuntimeError) as e:  # this plan does not apply here
            row.why_not = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            return row
        if cand.name == "sac-keep-all":  # the target that runs it: its saved bytes, rounded up
            kept = stats.get("saved_bytes_no_recompute") or 0
            row.flags = cand.flags.format(target_gb=f"{math.ceil(kept / 2**30 * 1e4) / 1e4:g}")
        row.peak, row.step_s, row.host = int(pred.peak), float(pred.step_s), int(pred.host)
        row.fits = row.peak <= self.budget
        row.prediction, row.result = pred, (fw, bw, sub)
        saved = stats.get("saved_bytes")
        row.saved = int(saved) if saved is not None else None
        return row

    def _target(self, joint, joint_inputs, kwargs, passes, ctx, base: Row) -> list:
        """SAC with a memory target sized to the budget: the saved bytes the default plan keeps,
        plus what its peak leaves of the budget (less where it is over), corrected by what each
        try's peak missed."""
        cand = ROUNDS[0][1][1]
        if base.peak is None or base.saved is None:
            return [Row(cand.name, cand.flags, why_not="the default plan could not be predicted")]
        target, row = base.saved + (self.budget - base.peak), None
        for _ in range(_TARGET_TRIES):
            if target < 0:
                break
            row = self._trial(cand, joint, joint_inputs, kwargs, passes, ctx,
                              extra={"sac_memory_target": float(target)})
            row.flags = cand.flags.format(target_gb=f"{target / 2**30:.4g}")
            if row.peak is None or row.fits:
                break
            target -= row.peak - self.budget
        if row is None:
            return [Row(cand.name, cand.flags.format(target_gb="<0"),
                        why_not="the budget leaves nothing for saved activations")]
        return [row]

    # -- when nothing fits ----------------------------------------------------------------------
    def nothing_fits(self, static: int = 0) -> str:
        """The one-line error: the longest length that fits, and what would fit the request
        (``static``: the model state alone is over the budget, no length fits)."""
        tried = [r for r in self.rows if r.peak is not None]
        S, B = self.requested, self.budget
        if static:
            return (f"AutoSP: no plan fits any sequence length in the memory budget of "
                    f"{B / MiB:.0f} MiB per rank (--memory-budget-gb {B / 2**30:.4g}): the "
                    f"parameters, optimizer states and batch alone take {static / MiB:.0f} MiB; "
                    f"shard them (--use-torch-fsdp2 over more ranks) or raise the budget above "
                    f"{static / 2**30:.3g} GiB plus the activations")
        if not tried:
            whys = "; ".join(f"{r.name}: {r.why_not}" for r in self.rows)
            return (f"AutoSP: no memory plan could be predicted for this model ({whys}); run "
                    f"without --memory-budget-gb (explicit plan flags) and report this")
        least = min(tried, key=lambda r: r.peak)
        best_len, best = 0, None
        for r in tried:
            if r.prediction is not None and r.prediction.longest is not None:
                L = r.prediction.longest(B, S)
                if best is None or L > best_len:
                    best_len, best = L, r
        text = (f"AutoSP: no plan fits {S} tokens in the memory budget of {B / MiB:.0f} MiB per "
                f"rank (--memory-budget-gb {B / 2**30:.4g}): the smallest predicted peak is "
                f"{least.name}'s {least.peak / MiB:.0f} MiB")
        if best is not None and best_len:
            P = max(1, self.world)
            ranks = -(-S * P // best_len)
            text += (f"; the longest length that fits is {best_len} tokens ({best.name}: "
                     f"{best.flags}); {S} tokens fit on about {ranks} sequence-parallel ranks "
                     f"({S // ranks} tokens a rank, as {best_len} tokens on {P} here)")
        elif best is not None:
            text += ("; no length fits: the activations of the shortest sequence are over "
                     "what the model state leaves")
        text += f", or a budget of at least {least.peak / 2**30:.3g} GiB"
        if least.host:
            text += f" (with {least.host / 2**30:.3g} GiB of host memory per rank)"
        return text


def _without_offload(rows: list, cand: Candidate) -> Optional[Row]:
    """The row of ``cand``'s plan without offload (None: ``cand`` does not offload)."""
    changes = dict(cand.changes)
    if not changes.pop("offload_activations", False):
        return None
    return next((r for r in rows if r.changes == changes), None)


# ---------------------------------------------------------------------------- ranks agree
def _namespace(group) -> str:
    from autosp_lm.parallel.collectives import group_name
    return f"autosp/memory_plan/{group_name(group)}"


def publisher(group, key: str) -> Callable:
    """The first rank's ``publish``: its decision (or error) into the default store."""
    from .schedule import default_store
    store = default_store()

    def publish(decision: dict) -> None:
        if store is not None:
            store.set(f"{_namespace(group)}/{key}", json.dumps(decision))
    return publish


def wait_for_decision(group, key: str, timeout: float) -> dict:
    """Another rank's wait for the first rank's decision (an AutoSPError after ``timeout``)."""
    from .schedule import default_store
    store = default_store()
    entry = f"{_namespace(group)}/{key}"
    start = time.monotonic()
    while not store.check([entry]):
        if time.monotonic() - start > timeout:
            raise AutoSPError(f"AutoSP: the first rank of the sequence-parallel group did not "
                              f"choose a memory plan within {timeout:.0f} s (did it fail? its "
                              f"log says why)")
        time.sleep(_POLL)
    decision = json.loads(store.get(entry))
    if "candidates" in decision and "error" in decision:
        raise NoPlanFits(decision["error"], decision["candidates"])
    if "error" in decision:
        raise AutoSPError(decision["error"])
    return decision
