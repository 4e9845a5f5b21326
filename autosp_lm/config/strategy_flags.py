"""The strategy flags as the strategies' option dataclasses, and the memory budget.

:func:`strategy_options` turns the validated flags into the chosen strategy's ``Options``
(``RecipeOptions`` fields for none / ``--ulysses`` / ``--ring``, ``AutoSPOptions`` fields for
``--autosp``). ``--memory-budget-gb`` (:func:`add_memory_budget_arg`) is the bytes a rank may
use: under ``--autosp`` the compiler then chooses the fastest plan predicted to fit
(:mod:`autosp_lm.compiler.memory_plan`), unless explicit plan flags (:data:`PLAN_FLAGS`) name
the plan, which they then do. Split from :mod:`.arguments` where the ideas part: the flags'
declarations and checks there, what the strategies receive here.
"""
from __future__ import annotations

from .cli import ArgumentError
from ..compiler import DEFAULT_BUDGET


def strategy_options(args, name: str, sac: bool):
    """The options dataclass of strategy ``name`` (with SAC on or off, as checked by
    :func:`autosp_lm.config.build.build_run_config`) from the flags."""
    from ..strategies import strategy_class
    recipe = recipe_options(args)
    fields = {"none": dict(compile=args.compile, sac=sac, backend=args.compile_backend,
                           sac_budget=args.sac_recompute_budget, **recipe),
              "ulysses": dict(compile=args.compile, backend=args.compile_backend,
                              ulysses_degree=args.ulysses_degree,
                              attention_head_chunks=getattr(args, "attention_head_chunks", 1),
                              **recipe),
              "ring": dict(compile=args.compile, backend=args.compile_backend, **recipe),
              "autosp": dict(sac=sac, backend=args.compile_backend,
                             sac_budget=args.sac_recompute_budget, verbose=False,
                             ulysses_degree=args.ulysses_degree,
                             **_autosp_memory_options(args))}[name]
    return strategy_class(name).Options(**fields)


#: the hand-written strategies' memory flags (strategies.memory.RecipeOptions fields) and what
#: does their job under --autosp
RECIPE_FLAGS = {
    "recompute_granularity": ("--recompute-granularity", "SAC chooses what to recompute; "
                              "--sac-memory-target-gb G recomputes until the saved bytes fit G"),
    "chunked_loss": ("--chunked-loss", "SAC fuses and chunks the loss head by default"),
    "tiled_mlp": ("--tiled-mlp", "SAC tiles token-local regions by default"),
    "cpu_offloading": ("--cpu-offloading", "use --offload-activations"),
}


def recipe_options(args) -> dict:
    """The memory flags of none / --ulysses / --ring as RecipeOptions fields."""
    return dict(recompute_granularity=getattr(args, "recompute_granularity", None),
                recompute_method=getattr(args, "recompute_method", "uniform"),
                recompute_num_layers=getattr(args, "recompute_num_layers", 1),
                chunked_loss=bool(getattr(args, "chunked_loss", False)) or None,
                tiled_mlp=bool(getattr(args, "tiled_mlp", False)),
                tiled_mlp_chunk_tokens=getattr(args, "tiled_mlp_chunk_tokens", 0),
                cpu_offloading=bool(getattr(args, "cpu_offloading", False)),
                cpu_offloading_num_layers=getattr(args, "cpu_offloading_num_layers", 0))


def _autosp_memory_options(args) -> dict:
    """The SAC memory flags as :class:`~autosp_lm.compiler.AutoSPOptions` fields."""
    target = getattr(args, "sac_memory_target_gb", None)
    return dict(sac_memory_target=None if target is None else target * 2**30,
                sac_recommunicate=not getattr(args, "sac_never_recommunicate", False),
                sac_device=getattr(args, "sac_device", None),
                offload_activations=bool(getattr(args, "offload_activations", False)),
                offload_threshold=int(getattr(args, "offload_threshold_mb", 1.0) * 2**20),
                sequence_tiling=getattr(args, "sequence_tiling", True),
                max_context=bool(getattr(args, "max_context", False)),
                attention_head_groups=getattr(args, "attention_head_groups", 1),
                choose_plan=not plan_flags(args))


def plan_flags(args) -> list:
    """The flags given that name an AutoSP memory plan: they win over the budget's choice."""
    return [flag for flag, on in (
        ("--sac-recompute-budget", getattr(args, "sac_recompute_budget", DEFAULT_BUDGET)
         != DEFAULT_BUDGET),
        ("--sac-memory-target-gb", getattr(args, "sac_memory_target_gb", None) is not None),
        ("--offload-activations", getattr(args, "offload_activations", False)),
        ("--max-context", getattr(args, "max_context", False)),
        ("--attention-head-groups", getattr(args, "attention_head_groups", 1) != 1)) if on]


def add_memory_budget_arg(group) -> None:
    group.add_argument(
        "--memory-budget-gb", type=float,
        help="AutoSP: the memory a rank may use (GiB, allocated tensors); the compiler chooses "
             "the fastest plan predicted to fit (SAC, a memory target, offload, head groups, "
             "the max-context mode) or stops before step 1 naming the longest length that fits. "
             "Default on CUDA: the device's memory minus 4 GiB (CUDA context, NCCL, "
             "fragmentation); on CPU: no budget, no choice. Explicit plan flags win "
             "(docs/sac.md, \"The memory budget\")")


def validate_memory_budget(args, strategy: str, sac: bool) -> None:
    budget = getattr(args, "memory_budget_gb", None)
    if budget is None:
        return
    if budget <= 0:
        raise ArgumentError(f"--memory-budget-gb must be > 0 GiB, got {budget}")
    if strategy != "autosp" or not sac:
        raise ArgumentError("--memory-budget-gb: AutoSP chooses its memory plan to fit it; use it "
                            "with --autosp (and SAC on, the default); the other strategies' plans "
                            "are predicted offline by tools/plan_memory.py")


