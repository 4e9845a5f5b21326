"""The memory planner: per-GPU peak memory and the longest trainable context, without a GPU.

One rank's training step of a strategy is compiled on fake tensors (the model built under
``FakeTensorMode``: no parameter memory; the process group faked as
``tools/benchmark_sp.py --simulate-world-size`` does), with the sequence dimension dynamic, and its
partitioned forward/backward graphs are captured (AutoSP: its own aot_eager pass stack; the
hand-written strategies: AOTAutograd's min-cut partitioner, :func:`~autosp_lm.compiler.capture.
capture_backend`). The live tensors of the step are then simulated in execution order on those
graphs (:func:`~autosp_lm.compiler.liveness.simulate_step`) at any sequence length (the sizes are
sympy expressions of the traced length), and the planner adds what the graphs do not hold:
parameters, optimizer states, the batch, the gradient-reduction buckets and the optimizer's
temporaries, per the sharding. ``docs/plan_memory.md`` states the model and its limits;
``tools/plan_memory.py`` is the command line, ``--validate`` (:mod:`autosp_lm.memory_plan_check`)
compares predictions with measured peaks.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .compiler.capture import Partition, capture_backend, simulate_captured
from .compiler.workspace import kernel_workspace
from .models import build_model, preset_config

GiB = 2 ** 30

_AC = {"compile": True, "recompute_granularity": "full", "recompute_method": "uniform",
       "recompute_num_layers": 1, "chunked_loss": True}
#: planner strategy name -> (strategy registry name, options); the names of tools/benchmark_sp.py
STRATEGIES = {
    "none": ("none", {"compile": True}),
    "ulysses": ("ulysses", {"compile": True}),
    "ring": ("ring", {"compile": True}),
    "autosp": ("autosp", {"sac": True}),
    "autosp-nosac": ("autosp", {"sac": False}),
    # the memory techniques users switch on with the hand-written strategies
    # (strategies/memory.py): Megatron/torchtitan full recomputation (every block one checkpoint)
    # with a chunked loss head, and the ALST recipe (+ tiled MLP + the checkpointed block inputs
    # in host memory). The planner traces the compiled graphs, and the host offload runs
    # saved-tensor hooks that cannot be compiled: "+alst" is traced without it and the offload
    # is modelled on the graphs (HOST_OFFLOAD; docs/plan_memory.md "Host memory")
    "none+ac": ("none", dict(_AC)),
    "ulysses+ac": ("ulysses", dict(_AC)),
    "ring+ac": ("ring", dict(_AC)),
    "ulysses+alst": ("ulysses", dict(_AC, tiled_mlp=True)),
    "ring+alst": ("ring", dict(_AC, tiled_mlp=True)),
}
#: planner strategies whose checkpointed block inputs live in host memory between the forward and
#: the backward (the ALST recipe's ``cpu_offloading``), modelled on the traced graphs
HOST_OFFLOAD = {"ulysses+alst", "ring+alst"}
DEFAULT_RESERVE_GB = 4.0  # CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation
BATCH_KEYS = ("input_ids", "labels", "position_ids")
GPUS_PER_NODE = 8  # the node size the plan assumes (H100/H200 nodes)


def parse_strategies(text: str) -> list:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise ValueError(f"unknown strategy {', '.join(bad) or text!r}; choose a comma list of: "
                         f"{', '.join(STRATEGIES)}")
    return names


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
    from .parallel import mesh
    from .parallel.state import init_simulated_world
    node_size = os.environ.get("LOCAL_WORLD_SIZE")
    init_simulated_world(world, ranks_per_node=min(world, GPUS_PER_NODE))
    mesh._CACHE.clear()  # Ulysses / ring sub-groups belong to one world: made again in this one
    try:
        yield
    finally:
        dist.destroy_process_group()
        mesh._CACHE.clear()
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


def build_strategy_for(name: str, sp: int, *, store: list, offload: bool = False,
                       device: str = "cpu", shard_mesh: bool = False,
                       offload_checkpoints: bool = False):
    """``(strategy, parallel state)`` of planner strategy ``name`` on ``sp`` ranks of the
    initialized (fake) group: AutoSP on aot_eager, the others compiled by the capture backend
    (``device``: where a real step of it runs; the planner traces on ``cpu``; ``shard_mesh``:
    the mesh of the sharded modes too, for a measured ``--use-torch-fsdp2`` step;
    ``offload_checkpoints``: the compiled program offloads the checkpoints' inputs, as the
    planner models :data:`HOST_OFFLOAD`'s, for a measured step)."""
    from .parallel.state import init_parallel
    from .strategies import build_strategy
    reg, extra = STRATEGIES[name]
    ps = init_parallel(1 if reg == "none" else sp, device=device, shard_mesh=shard_mesh)
    if reg == "autosp":
        strategy = build_strategy(reg, ps, backend="aot_eager", verbose=False,
                                  offload_activations=offload, **extra)
    else:
        if offload:
            raise ValueError(f"--offload-activations is an AutoSP option; strategy {name!r} has "
                             f"no activation offload (use autosp)")
        strategy = build_strategy(reg, ps, backend=capture_backend(store, offload_checkpoints),
                                  **extra)
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
    depth: dict = field(default_factory=dict)  # depth extrapolation (memory_depth.py) or why not
    # AutoSP with graph FSDP (--use-torch-fsdp2): the parameters were sharded over this many
    # ranks when traced, so the gathers, the re-gathers of the backward and the reduce-scatters
    # are nodes of the captured graphs (counted exactly); 0: traced unsharded
    graph_fsdp_world: int = 0
    inner_cache: dict = field(default_factory=dict, repr=False)  # custom ops' inner peaks
    walks: dict = field(default_factory=dict, repr=False)  # the graphs' liveness analysis

    def local_length(self, seq: int) -> int:
        n = seq * self.input_length
        if n % self.traced_seq:
            raise ValueError(f"memory plan: {seq} tokens do not split like the traced "
                             f"{self.traced_seq} ({self.input_length} per call)")
        return n // self.traced_seq

    def step(self, seq: int, grad_fraction: float = 1.0, target: Optional[str] = None):
        """Simulated live memory of the step's graphs at ``seq`` tokens (above the inputs); the
        custom ops' bodies run in the (fake) process group of the trace, set up again here.
        ``target`` (``cpu``/``cuda``): count the attention kernels' own workspace on that
        device (:mod:`autosp_lm.compiler.workspace`); None: op outputs only."""
        ws = kernel_workspace(target) if target else None
        with self.world():
            return simulate_captured(self.partitions, self.input_length, self.local_length(seq),
                                     grad_fraction=grad_fraction, inner_cache=self.inner_cache,
                                     walks=self.walks, workspace=ws,
                                     host_offload=self.strategy in HOST_OFFLOAD)

    @contextlib.contextmanager
    def world(self):
        W = max(self.sp, self.graph_fsdp_world)
        if W == 1 or (dist.is_available() and dist.is_initialized()):
            yield
            return
        from .parallel import mesh
        from .parallel.state import init_parallel
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


def graph_fsdp_world(name: str, layout: Optional["Layout"]) -> int:
    """The ranks to trace strategy ``name``'s parameters sharded over: ``layout.world`` for
    AutoSP under ``--use-torch-fsdp2`` (graph FSDP: its gathers are ops of the compiled graph, so
    the trace holds them), else 0 (traced unsharded; native FSDP2's gathers run in module hooks
    outside the graphs and :func:`predict` adds them analytically)."""
    if layout is None or not layout.fsdp2 or layout.world <= 1:
        return 0
    return layout.world if STRATEGIES[name][0] == "autosp" else 0


def trace_step(name: str, cfg, sp: int, seq: int, *, bf16: bool = False, offload: bool = False,
               depth: bool = True, check_depth: bool = False,
               layout: Optional["Layout"] = None) -> TracedStep:
    """Compile strategy ``name``'s step for one of ``sp`` ranks at ``seq`` tokens on fake tensors
    and capture its partitioned graphs (nothing is allocated: the process stays small). With
    ``depth`` (the default) a model of alike blocks is traced cut to 2 and 3 blocks and its step
    extrapolated to the full depth (:mod:`autosp_lm.memory_depth`; ``check_depth``: a third trace
    at 4 blocks checks the extrapolation at every length); otherwise the full model is traced.
    ``layout``: the job's placement of the model state; AutoSP under FSDP2 is traced with its
    parameters sharded over ``layout.world`` ranks (:func:`graph_fsdp_world`)."""
    fsdp_world = graph_fsdp_world(name, layout)
    if depth:
        from .memory_depth import trace_by_depth
        return trace_by_depth(name, cfg, sp, seq, bf16=bf16, offload=offload, check=check_depth,
                              fsdp_world=fsdp_world)
    traced = trace_full(name, cfg, sp, seq, bf16=bf16, offload=offload, fsdp_world=fsdp_world)
    traced.depth = {"extrapolated": False, "reason": "--no-depth-extrapolation",
                    "blocks": len(traced.block_bytes)}
    return traced


def model_bytes(model) -> tuple:
    """(fp32 bytes of every parameter, each storage once, in model order; fp32 parameter bytes
    of each transformer block)."""
    from .parallel.fsdp import block_list
    seen, pbytes = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            pbytes.append(p.numel() * 4)
    blocks = block_list(model)
    return pbytes, ([sum(p.numel() * 4 for p in b.parameters()) for b in blocks] if blocks else [])


def trace_full(name: str, cfg, sp: int, seq: int, *, bf16: bool = False,
               offload: bool = False, fsdp_world: int = 0) -> TracedStep:
    """:func:`trace_step` of the model as configured (every block traced); ``fsdp_world``:
    AutoSP's parameters sharded over that many ranks by graph FSDP as ``pretrain.py
    --use-torch-fsdp2`` does (a multiple of ``sp``; 0: unsharded)."""
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
                                          shard_mesh=bool(fsdp_world))
        pbytes, block_bytes = model_bytes(model)  # fp32 bytes of the whole parameters
        if fsdp_world:
            from .parallel.sharding_kinds import build_sharding
            with mode:  # the shards of fake parameters; the gathers are traced into the graph
                build_sharding("graph_fsdp", ps, bf16=bf16).wrap(model)
        elif bf16:  # Megatron-style bf16: the model computes with bf16 parameters
            from .parallel.precision import cast_parameters
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
    if not parts:
        raise RuntimeError(f"memory plan: strategy {name!r} produced no partitioned graph")
    length = _input_length(parts)
    zigzag = reg == "ring" or plan.get("layout") == "zigzag"
    torch._dynamo.reset()
    return TracedStep(name, 1 if reg == "none" else sp, seq, length or seq, parts, pbytes,
                      block_bytes, plan, zigzag, graph_fsdp_world=fsdp_world)


def _input_length(parts: list) -> Optional[int]:
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


@dataclass
class Layout:
    """How the job places the model state on ``world`` ranks."""

    world: int
    fsdp2: bool = False
    bf16: bool = False  # Megatron-style: bf16 compute parameters, fp32 main ones (precision.py)
    # the step's device: the attention kernels' workspace (compiler/workspace.py) is that of
    # its kernels; the optimizer path is torch's fused AdamW on both (no temporaries)
    device: str = "cuda"
    host_bytes: int = 0  # host memory per GPU for offloaded activations (0: no limit)


def _grad_buckets(param_bytes: list, limit: int) -> int:
    """The largest flat buffer of the gradient all-reduce (parallel/grads.py's buckets)."""
    from .parallel.grads import BUCKET_BYTES
    limit = limit or BUCKET_BYTES
    best = size = 0
    for b in param_bytes:
        if size and size + b > limit:
            best, size = max(best, size), 0
        size += b
    return max(best, size)


def predict(traced: TracedStep, seq: int, layout: Layout) -> dict:
    """Per-rank bytes of one training step at ``seq`` tokens: the breakdown at the peak, the
    peak and the phase it is in (``step``: forward/backward, ``optimizer``: after it)."""
    W = layout.world
    n_bytes = sum(traced.param_bytes)  # fp32
    shard = 1.0 / W if layout.fsdp2 else 1.0
    params = int(n_bytes * shard)  # fp32 (main) parameters
    optimizer = 2 * params
    grads = params
    if layout.bf16 and not layout.fsdp2:  # Megatron-style bf16: the bf16 compute copies too
        params += n_bytes // 2
    batch = 8 * seq * len(BATCH_KEYS)
    if traced.strategy == "ring":  # the zigzag slices are copies (contiguous ones are views)
        batch += 8 * (seq // traced.sp) * len(BATCH_KEYS)
    graph_fsdp = traced.graph_fsdp_world
    if graph_fsdp and (not layout.fsdp2 or graph_fsdp != W):
        raise ValueError(f"memory plan: {traced.strategy!r} was traced with its parameters "
                         f"sharded over {graph_fsdp} ranks (graph FSDP); predict it for that "
                         f"layout (FSDP2 on {graph_fsdp} ranks), not "
                         f"{'FSDP2 on ' + str(W) if layout.fsdp2 else 'unsharded on ' + str(W)}"
                         f" ranks: trace it again with this layout")
    # graph FSDP's gradients leave the graph reduce-scattered (their traced size is the shard)
    sim = traced.step(seq, grad_fraction=1.0 if graph_fsdp else shard, target=layout.device)
    not_counted = dict(simulate_captured.not_counted)
    fsdp = 0
    if layout.fsdp2 and W > 1 and not graph_fsdp:
        # native FSDP2 (module hooks, outside the graphs), gathered units: the root (vocabulary
        # matrices) kept for the step, two blocks (current + prefetch), one block's full fp32
        # gradients before its reduce-scatter
        gdt = 2 if layout.bf16 else 4
        block = max(traced.block_bytes or [0])
        root = n_bytes - sum(traced.block_bytes)
        fsdp = int((root + 2 * block) * gdt / 4 + block)
    bucket = _grad_buckets(traced.param_bytes, 0) if (W > 1 and not layout.fsdp2) else 0
    temp = 0  # fused AdamW (CUDA and CPU, training/optimizer.py) allocates no temporaries
    step_phase = {"parameters": params, "optimizer states": optimizer, "batch": batch,
                  "step (activations, gradients, transients)": sim.peak}
    if fsdp:
        step_phase["FSDP gathered parameters / gradient buffers"] = fsdp
    opt_phase = {"parameters": params, "optimizer states": optimizer, "batch": batch,
                 "gradients": grads,
                 "gradient all-reduce bucket / optimizer temporaries": max(bucket, temp)}
    s_total, o_total = sum(step_phase.values()), sum(opt_phase.values())
    phase, breakdown = (("step", step_phase) if s_total >= o_total else ("optimizer", opt_phase))
    return {"strategy": traced.strategy, "seq_length": seq, "sp": traced.sp, "world_size": W,
            "peak_bytes": max(s_total, o_total), "peak_phase": phase,
            # offloaded activations (AutoSP's offload, ALST's checkpoint inputs) in host memory
            "host_bytes": sim.host, "host_budget_bytes": layout.host_bytes,
            "fits_host": not layout.host_bytes or sim.host <= layout.host_bytes,
            "peak_node": sim.peak_at if phase == "step" else "optimizer step",
            "step_peak_phase": sim.peak_phase, "breakdown": breakdown,
            "saved_activations_bytes": sim.saved, "step_live_peak_bytes": sim.peak,
            "static_bytes": params + optimizer + batch, "plan": traced.plan,
            "depth": traced.depth,
            "custom_ops_not_counted": not_counted}


def granularity(traced: TracedStep) -> int:
    """Sequence lengths searched: multiples of the SP size (twice it for the zigzag layout) and
    of 128."""
    step = 2 * traced.sp if traced.zigzag else traced.sp
    return step * 128 // math.gcd(step, 128)


def search_max(traced: TracedStep, layout: Layout, budget: int, *, cap: int = 1 << 26,
               stats: Optional[dict] = None) -> int:
    """The longest length (a multiple of :func:`granularity`, at most ``cap``) whose predicted
    peak fits ``budget`` bytes, on this trace (0: not even the smallest). The peak grows with the
    length; the answer is the one a bisection gives (``L`` fits, ``L + granularity`` does not),
    found by interpolation in a bracket (the peak is nearly affine in the length: a handful of
    predictions instead of a doubling and a bisection; bisection steps where it is not).
    ``stats["predictions"]`` counts the lengths evaluated."""
    g = granularity(traced)
    top = max(g, cap // g * g)
    memo: dict = {}

    def peak(L: int) -> int:
        # a plan over the host budget does not fit: its host bytes, scaled to the device
        # budget, stand for the peak (both grow with L)
        if L not in memo:
            r = predict(traced, L, layout)
            host = r["host_bytes"] * budget // layout.host_bytes if layout.host_bytes else 0
            memo[L] = max(r["peak_bytes"], host if r["fits_host"] else max(host, budget + 1))
            if stats is not None:
                stats["predictions"] = stats.get("predictions", 0) + 1
        return memo[L]

    def down(x: float) -> int:
        return int(x // g) * g

    if peak(g) > budget:
        return 0
    lo, hi = g, None  # lo fits; hi (None: not found yet) does not
    prev = None  # the fitting point before lo: the slope while no hi is known
    side, run = None, 0  # the end moved last inside a bracket, and how many times in a row
    while hi is None or hi - lo > g:
        if hi is None:
            if lo == top:
                return lo
            if prev is None:  # one point: probe at the traced length (at least twice lo)
                guess = max(2 * lo, down(traced.traced_seq))
            else:  # extrapolate the last two fitting points
                slope = (peak(lo) - peak(prev)) / (lo - prev)
                guess = top if slope <= 0 else down(lo + (budget - peak(lo)) / slope)
            guess = min(top, max(lo + g, guess))
        else:
            span = peak(hi) - peak(lo)
            guess = down(lo + (budget - peak(lo)) * (hi - lo) / span) if span > 0 else lo
            if run >= 2:  # interpolation keeps moving one end (regula falsi's stall): bisect
                guess = down((lo + hi) // 2)
            guess = min(hi - g, max(lo + g, guess))
        bracketed, fits = hi is not None, peak(guess) <= budget
        if fits:
            prev, lo = lo, guess
        else:
            hi = guess
        if bracketed:
            run = run + 1 if side == fits else 1
            side = fits
    return lo


def find_max_seq_length(name: str, cfg, sp: int, layout: Layout, budget: int, *,
                        bf16: bool = False, offload: bool = False, traced: TracedStep = None,
                        confirm: bool = True, rounds: int = 3, depth: bool = True,
                        check_depth: bool = False) -> dict:
    """:func:`search_max` for strategy ``name``; with ``confirm`` the step is traced again at the
    length found (the compiler's choices, e.g. SAC's, depend on the traced length) and searched
    on that trace until the length is stable (at most ``rounds`` traces). Traces are made for
    ``layout`` (AutoSP under FSDP2: its parameters sharded, :func:`graph_fsdp_world`)."""
    traced = traced or trace_step(name, cfg, sp, 16384 if sp <= 8 else 2048 * sp, bf16=bf16,
                                  offload=offload, depth=depth, check_depth=check_depth,
                                  layout=layout)
    history = []
    stats: dict = {}
    best = search_max(traced, layout, budget, stats=stats)
    history.append({"traced_seq": traced.traced_seq, "found": best, **stats})
    for _ in range(rounds - 1 if confirm else 0):
        if best == 0 or best == traced.traced_seq:
            break
        traced = trace_step(name, cfg, sp, best, bf16=bf16, offload=offload, depth=depth,
                            check_depth=check_depth, layout=layout)
        stats = {}
        again = search_max(traced, layout, budget, stats=stats)
        history.append({"traced_seq": traced.traced_seq, "found": again, **stats})
        if again == best:
            break
        best = again
    out = {"strategy": name, "sp": traced.sp, "world_size": layout.world,
           "max_seq_length": best, "budget_bytes": budget, "traces": history,
           "confirmed": best == 0 or best == traced.traced_seq, "depth": traced.depth}
    if best:
        out["at_max"] = predict(traced, best, layout)
    return out
