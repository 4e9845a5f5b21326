"""The memory planner's trace: one rank's training step of a strategy compiled on fake tensors.

The model is built under ``FakeTensorMode`` (no parameter memory), the process group faked as
``tools/benchmark_sp.py --simulate-world-size`` does (:func:`simulated_world`), the sequence
dimension dynamic, and the step's partitioned forward/backward graphs captured (AutoSP: its own
aot_eager pass stack; the hand-written strategies: AOTAutograd's min-cut partitioner,
:func:`~autosp_lm.planner.capture.capture_backend`). :class:`TracedStep` simulates their live
tensors at any sequence length; :mod:`.plan` adds what the graphs do not hold.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..models import build_model, preset_config
from ..parallel import mesh
from ..parallel.fsdp import block_list
from ..parallel.precision import cast_parameters
from ..parallel.sharding_kinds import build_sharding
from ..parallel.state import init_parallel, init_simulated_world
from ..strategies import build_strategy
from ..strategies.recipes import RECIPES, planner_spec
from .capture import Partition, capture_backend, simulate_captured
from .timing import step_time
from .workspace import kernel_workspace

#: the planner's table (tools/plan_memory.py --strategy; its --validate default): planner name ->
#: (strategy registry name, the options it traces), the recipes of
#: :mod:`autosp_lm.strategies.recipes` (the same names as pretrain.py --recipe and
#: tools/benchmark_sp.py). The eager ALST / UPipe recipes (ulysses+alst, ring+alst, ulysses+upipe)
#: are traced as their compiled program, whose offload ops (compiler/offload.py) move the same
#: block inputs: :data:`MODELLED` says so in the reports
PLANNED = ("none", "ulysses", "ring", "autosp", "autosp-nosac", "autosp-offload", "autosp-max",
           "autosp-max-offload", "none+ac", "ulysses+ac", "ring+ac", "ulysses+alst", "ring+alst",
           "ulysses+upipe")
STRATEGIES = {n: planner_spec(n)[:2] for n in PLANNED}
#: planner name -> why the traced program stands for the recipe (where it is not the recipe's own)
MODELLED = {n: planner_spec(n)[2] for n in PLANNED if planner_spec(n)[2]}
#: planner strategies that keep activations in host memory between the forward and the backward
#: through the hand-written recipes' ``cpu_offloading`` (the benchmark also runs them eagerly)
HOST_OFFLOAD = {n for n, (_, o) in STRATEGIES.items() if o.get("cpu_offloading")}
BATCH_KEYS = ("input_ids", "labels", "position_ids")
GPUS_PER_NODE = 8  # the node size the plan assumes (H100/H200 nodes)


def parse_strategies(text: str) -> list:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    for name in bad:
        if name in RECIPES:  # a recipe of another tool: why the planner does not list it
            planner_spec(name)  # (ValueError: one the planner does not model)
            twin = [n for n, spec in STRATEGIES.items() if spec == planner_spec(name)[:2]]
            raise ValueError(f"recipe {name!r} is not in the planner's table"
                             + (f"; {twin[0]!r} traces the same program" if twin else "")
                             + f": choose a comma list of: {', '.join(STRATEGIES)}")
    if bad or not names:
        raise ValueError(f"unknown strategy {', '.join(bad) or text!r}; choose a comma list of: "
                         f"{', '.join(STRATEGIES)}")
    return names


def modelled_lines(names) -> list:
    """One line per :data:`MODELLED` note of the strategies ``names``, naming them: what a
    report prints once, not per row."""
    notes: dict = {}
    for n in dict.fromkeys(names):
        if n in MODELLED:
            notes.setdefault(MODELLED[n], []).append(n)
    return [f"modelled: {', '.join(ns)}: {note}" for note, ns in notes.items()]


@contextlib.contextmanager
def simulated_world(world: int):
    """A fake process group of ``world`` ranks for the block (none for ``world == 1``), with
    :data:`GPUS_PER_NODE` ranks per node as AutoSP's plan sees it (Ulysses within a node, a ring
    across nodes where the SP group spans several)."""
    if world <= 1:
        yield
        return
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("memory plan: a process group is already initialized; the planner "
                           "fakes its own (run it in a fresh process)")
    node_size = os.environ.get("LOCAL_WORLD_SIZE")
    init_simulated_world(world, ranks_per_node=min(world, GPUS_PER_NODE))
    mesh.forget_groups()  # Ulysses / ring sub-groups belong to one world: made again in this one
    try:
        yield
    finally:
        dist.destroy_process_group()
        mesh.forget_groups()
        if node_size is None:  # the node size seen by the plan was for this block only
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = node_size


def synthetic_batch(seq: int, vocab: int, *, fake: bool) -> dict:
    """One micro batch of ``seq`` tokens (micro batch size 1), random tokens unless fake."""
    ids = (torch.zeros(1, seq, dtype=torch.long) if fake else
           torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1)))
    return {"input_ids": ids, "labels": ids.clone(),
            "position_ids": torch.arange(seq, dtype=torch.long)[None]}


def sac_device_for(device: str, sp: int) -> str:
    """The cost-model preset AutoSP's SAC prices its plan with when the step runs on ``device``
    with ``sp`` ranks: what ``compiler.cost_model.auto_device`` picks on such a job, with
    :data:`GPUS_PER_NODE` ranks a node (an H100 preset on CUDA, the local GPU's where there is
    one; the cross-node link when the SP group spans more than a node; ``cpu`` on CPU). SAC's
    choice depends on the relative costs of matmuls, attention and links, so a plan for GPUs
    priced as a CPU would be another plan than the one the GPUs run."""
    from ..compiler.cost_model import auto_device
    return auto_device(device, sp, ranks_per_node=GPUS_PER_NODE).name


def build_strategy_for(name: str, sp: int, *, store: list, offload: bool = False,
                       device: str = "cpu", shard_mesh: bool = False,
                       sac_device: Optional[str] = None):
    """``(strategy, parallel state)`` of planner strategy ``name`` on ``sp`` ranks of the
    initialized (fake) group: AutoSP on aot_eager, the others compiled by the capture backend
    (``device``: where a real step of it runs; the planner traces on ``cpu``; ``shard_mesh``:
    the mesh of the sharded modes too, for a measured ``--use-torch-fsdp2`` step; a recipe of
    :data:`HOST_OFFLOAD` offloads the checkpoints' inputs in its compiled program, as
    ``pretrain.py --compile --cpu-offloading`` does; ``sac_device``: AutoSP's
    cost-model preset, default :func:`sac_device_for` ``device``)."""
    reg, extra = STRATEGIES[name]
    ps = init_parallel(1 if reg == "none" else sp, device=device, shard_mesh=shard_mesh)
    if reg == "autosp":
        extra = dict(extra, sac_device=sac_device or sac_device_for(device, sp))
        offload = extra.pop("offload_activations", False) or offload  # (both: once)
        strategy = build_strategy(reg, ps, backend="aot_eager", verbose=False,
                                  offload_activations=offload, **extra)
    else:
        if offload:
            raise ValueError(f"--offload-activations is an AutoSP option; strategy {name!r} has "
                             f"no activation offload (use autosp)")
        strategy = build_strategy(reg, ps, backend=capture_backend(
            store, bool(extra.get("cpu_offloading"))), **extra)
    return strategy, ps


def dynamic_inputs(name: str):
    """The hand-written strategies compile their local slices: every size of the compiled
    function's inputs is dynamic (size-1 dims specialize); AutoSP marks its sequence dims."""
    if STRATEGIES[name][0] == "autosp":
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(assume_static_by_default=False)


def partitions_of(strategy, store: list) -> list:
    if store:
        return list(store)
    backend = getattr(getattr(strategy, "runner", None), "backend", None)
    return [Partition(*p) for p in (getattr(backend, "partitions", None) or [])]


@dataclass
class TracedStep:
    """One rank's captured step of one strategy and what the planner needs of the model."""

    strategy: str
    sp: int
    traced_seq: int
    input_length: int  # length of the compiled function's sequence inputs at traced_seq
    partitions: list
    param_bytes: list  # fp32 bytes of every parameter (each storage once), in model order
    block_bytes: list  # fp32 parameter bytes of each transformer block
    plan: dict = field(default_factory=dict)  # AutoSP's U x R plan
    zigzag: bool = False
    depth: dict = field(default_factory=dict)  # depth extrapolation (planner/depth.py) or why not
    # AutoSP with graph FSDP (--use-torch-fsdp2): the parameters were sharded over this many
    # ranks when traced, so the gathers, the re-gathers of the backward and the reduce-scatters
    # are nodes of the captured graphs (counted exactly); 0: traced unsharded
    graph_fsdp_world: int = 0
    inner_cache: dict = field(default_factory=dict, repr=False)  # custom ops' inner peaks
    walks: dict = field(default_factory=dict, repr=False)  # the graphs' liveness analysis
    times: dict = field(default_factory=dict, repr=False)  # device name -> timing.StepTime
    stalls: dict = field(default_factory=dict, repr=False)  # (seq, device name) -> seconds
    node_cache: dict = field(default_factory=dict, repr=False)  # the nodes' prices

    def local_length(self, seq: int) -> int:
        n = seq * self.input_length
        if n % self.traced_seq:
            raise ValueError(f"memory plan: {seq} tokens do not split like the traced "
                             f"{self.traced_seq} ({self.input_length} per call)")
        return n // self.traced_seq

    def step_time(self, seq: int, device) -> float:
        """Predicted seconds of the step's forward + backward at ``seq`` tokens on ``device``
        (a cost-model ``DeviceParams``; :mod:`autosp_lm.planner.timing`): the compute stream's
        nodes, plus its waits for activation offload's copies back (:meth:`stall`)."""
        return self.compute_time(seq, device) + self.stall(seq, device)

    def compute_time(self, seq: int, device) -> float:
        """Seconds of the compute stream's nodes (:mod:`autosp_lm.planner.timing`), without
        the waits for offload's copies."""
        if device.name not in self.times:  # the graphs' cost by growth in length, priced once
            with self.world():  # (a ring attention's ranks: its group by name, in this world)
                self.times[device.name] = step_time(self.partitions, device, max(self.sp, 1))
        return self.times[device.name].at(self.local_length(seq) / self.input_length)

    def offloads(self) -> bool:
        """Whether the step moves activations through the offload ops."""
        from .liveness import is_reload
        return any(is_reload(n) for p in self.partitions for n in p.bw.graph.nodes)

    def stall(self, seq: int, device) -> float:
        """Seconds the compute stream waits for activation offload's copies back from the host
        at ``seq`` tokens on ``device`` (``liveness.Clock``, its ``host_bw``); 0 without
        offload."""
        key = (seq, device.name)
        if key not in self.stalls:
            self.stalls[key] = self.step(seq, target="cuda", clock=device).stall_s \
                if self.offloads() else 0.0
        return self.stalls[key]

    def _clock(self, device):
        """``(partition, ratio) -> Clock``: the pair's nodes priced on ``device`` (each node
        once per device, kept), its copies at ``device.host_bw``."""
        from .liveness import Clock
        from .timing import node_seconds

        def make(p, ratio):
            fw_s = node_seconds(p.fw, device, max(self.sp, 1), ratio, self.node_cache)
            bw_s = node_seconds(p.bw, device, max(self.sp, 1), ratio, self.node_cache)
            return Clock(lambda n: fw_s(n) + bw_s(n), device.host_bw)
        return make

    def step(self, seq: int, grad_fraction: float = 1.0, target: Optional[str] = None,
             clock=None):
        """Simulated live memory of the step's graphs at ``seq`` tokens (above the inputs); the
        custom ops' bodies run in the (fake) process group of the trace, set up again here.
        ``target`` (``cpu``/``cuda``): count the attention kernels' own workspace on that
        device (:mod:`autosp_lm.planner.workspace`); None: op outputs only. ``clock``: a
        cost-model device timing a CUDA step's streams (offload's stream-ordered frees, the
        stall it records for :meth:`stall`); None: copies are synchronous (CPU)."""
        ws = kernel_workspace(target) if target else None
        with self.world():
            sim = simulate_captured(self.partitions, self.input_length, self.local_length(seq),
                                    grad_fraction=grad_fraction, inner_cache=self.inner_cache,
                                    walks=self.walks, workspace=ws,
                                    clock=self._clock(clock) if clock is not None else None)
        if clock is not None:
            self.stalls[(seq, clock.name)] = sim.stall_s
        return sim

    @contextlib.contextmanager
    def world(self):
        W = max(self.sp, self.graph_fsdp_world)
        if W == 1 or (dist.is_available() and dist.is_initialized()):
            yield
            return
        with simulated_world(W):
            # the same group names as in the trace
            ps = init_parallel(self.sp, device="cpu", shard_mesh=bool(self.graph_fsdp_world))
            U, R = self.plan.get("ulysses_degree", 0), self.plan.get("ring_degree", 1)
            if U > 1 and R > 1:  # a 2-D plan's sub-groups, created again in the trace's order
                mesh.ulysses_ring_groups(ps.sp_group, U)
            yield


def model_config(model: str, overrides: Optional[dict] = None, seq: int = 0):
    cfg = preset_config(model, **dict(overrides or {}))
    if seq > cfg.max_position_embeddings:
        cfg = preset_config(model, **dict(overrides or {}, max_position_embeddings=seq))
    return cfg


def model_bytes(model) -> tuple:
    """(fp32 bytes of every parameter, each storage once, in model order; fp32 parameter bytes
    of each transformer block)."""
    seen, pbytes = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            pbytes.append(p.numel() * 4)
    blocks = block_list(model)
    return pbytes, ([sum(p.numel() * 4 for p in b.parameters()) for b in blocks] if blocks else [])


def trace_full(name: str, cfg, sp: int, seq: int, *, bf16: bool = False,
               offload: bool = False, fsdp_world: int = 0,
               sac_device: Optional[str] = None, configure=None) -> TracedStep:
    """:func:`trace_step` of the model as configured (every block traced); ``fsdp_world``:
    AutoSP's parameters sharded over that many ranks by graph FSDP as ``pretrain.py
    --use-torch-fsdp2`` does (a multiple of ``sp``; 0: unsharded); ``sac_device``: the
    cost-model preset of AutoSP's SAC (:func:`sac_device_for` the step's device; default
    ``cpu``). ``configure(strategy, model)``: called before the model is sharded and compiled
    (e.g. AutoSP's memory-plan options: tools/bench_memory_plan.py times the choice here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    reg = STRATEGIES[name][0]
    if fsdp_world and (reg != "autosp" or fsdp_world % sp):
        raise ValueError(f"memory plan: graph FSDP is traced for AutoSP on a world that is a "
                         f"multiple of the SP size, not {name!r} on {fsdp_world} ranks with "
                         f"SP {sp}")
    torch._dynamo.reset()
    store: list = []
    with simulated_world(max(sp, fsdp_world)):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = build_model(cfg)
            batch = synthetic_batch(seq, cfg.vocab_size, fake=True)
        strategy, ps = build_strategy_for(name, sp, store=store, offload=offload,
                                          shard_mesh=bool(fsdp_world), sac_device=sac_device)
        pbytes, block_bytes = model_bytes(model)  # fp32 bytes of the whole parameters
        if configure is not None:
            configure(strategy, model)
        if fsdp_world:
            with mode:  # the shards of fake parameters; the gathers are traced into the graph
                build_sharding("graph_fsdp", ps, bf16=bf16).wrap(model)
        elif bf16:  # Megatron-style bf16: the model computes with bf16 parameters
            with mode:
                cast_parameters(model)
        strategy.setup(model)
        backend = getattr(getattr(strategy, "runner", None), "backend", None)
        if backend is not None and hasattr(backend, "partitions"):
            backend.partitions = []  # AutoSP records its partitioned graphs for the plan
        with mode, dynamic_inputs(name):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _ = strategy.forward_loss(batch)
            loss.backward()
        parts = partitions_of(strategy, store)
        plan = dict(getattr(getattr(strategy.runner, "report", None), "plan", None) or {})
        sac_stats = getattr(getattr(strategy, "runner", None), "sac_stats", None) or []
        if sac_stats:  # the preset SAC priced its plan with, as the plan's JSON reports it
            plan["sac_device"] = sac_stats[-1].get("device")
    if not parts:
        raise RuntimeError(f"memory plan: strategy {name!r} produced no partitioned graph")
    length = input_length_of(parts)
    zigzag = reg == "ring" or plan.get("layout") == "zigzag"
    torch._dynamo.reset()
    return TracedStep(name, 1 if reg == "none" else sp, seq, length or seq, parts, pbytes,
                      block_bytes, plan, zigzag, graph_fsdp_world=fsdp_world)


def input_length_of(parts: list) -> Optional[int]:
    """The traced value of the sequence symbol of the forward's inputs (None: static)."""
    vals = set()
    for n in parts[0].fw.graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor):
            for s in v.shape:
                if isinstance(s, torch.SymInt):
                    vals.add(s.node.hint if s.node.hint is not None else int(s))
    if len(vals) > 1:
        raise RuntimeError(f"memory plan: the traced graph has several dynamic input sizes "
                           f"{sorted(vals)}; only the sequence may be dynamic")
    return vals.pop() if vals else None
