"""A recipe as ``pretrain.py``'s flags: ``--recipe NAME`` and the plan command.

A recipe (:mod:`autosp_lm.strategies.recipes`) is a strategy and some fields of its
``Options``; :func:`recipe_argv` writes them as the flags whose options they are
(:func:`option_flags`: ``max_context=True`` -> ``--max-context``), and :func:`apply_recipe`
makes the values those flags give the parser's defaults, so that flags given on the command line
win over the recipe's. The plan command (:mod:`.plan_command`) writes its options with the same
mapping, and reads both back through the trainer's parser.
"""
from __future__ import annotations

from .cli import ArgumentError, UsageError
from ..strategies import SP_STRATEGIES
from ..strategies.recipes import RECIPES, recipe

#: options whose flags are not ``--name`` / ``--no-name``: (option, value) -> flags
SPECIAL = {("compile", False): [],  # pretrain.py compiles the hand-written strategies on --compile
           ("sac_recommunicate", False): ["--sac-never-recommunicate"],
           ("sac_recommunicate", True): [],
           ("sequence_tiling", True): []}


def option_flags(key: str, value) -> list:
    """The ``pretrain.py`` flags that set strategy option ``key`` to ``value``."""
    if (key, value) in SPECIAL:
        return list(SPECIAL[(key, value)])
    flag = "--" + key.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + key.replace("_", "-")]  # --no-sac
    return [flag, str(value)]


def strategy_flag(registry: str) -> list:
    """The flag that chooses strategy ``registry`` (none: no flag)."""
    return [] if registry == "none" else [f"--{registry}"]


def options_argv(registry: str, options: dict) -> list:
    """The flags of strategy ``registry`` with ``options`` (AutoSP's default SAC left out)."""
    flags = []
    for key, value in options.items():
        if key == "sac" and value is True and registry == "autosp":
            continue  # AutoSP's default
        flags += option_flags(key, value)
    return flags


def recipe_argv(name: str) -> list:
    """``pretrain.py``'s flags for recipe ``name``: its strategy flag and its options."""
    r = recipe(name)
    return strategy_flag(r.strategy) + options_argv(r.strategy, dict(r.options))


def describe() -> str:
    """The recipes, one a line: name, compiled or eager, what runs (``--recipe list``)."""
    width = max(map(len, RECIPES))
    return "\n".join(f"{n:<{width}}  {r.strategy:<7}  {r.program:<8}  {r.description}"
                     for n, r in RECIPES.items())


def apply_recipe(parser, argv, args):
    """``args`` parsed again with recipe ``args.recipe``'s flags as the parser's defaults (the
    flags of ``argv`` win); ArgumentError where ``argv`` names another strategy than the
    recipe's. ``--recipe list`` prints the recipes and exits."""
    if args.recipe == "list":
        print(describe())
        raise SystemExit(0)
    try:
        r = recipe(args.recipe)
    except ValueError as e:
        raise UsageError(f"--recipe: {e} (`--recipe list` says what each runs)") from None
    given = [n for n in SP_STRATEGIES if getattr(args, n, False)]
    other = [n for n in given if n != r.strategy]
    if other:
        mine = f"--{r.strategy}" if r.strategy != "none" else "no sequence parallelism"
        raise ArgumentError(f"--recipe {r.name} runs {mine}, and --{other[0]} names another "
                            f"strategy: drop one")
    base = vars(parser.parse_args([]))
    preset = vars(parser.parse_args(recipe_argv(r.name)))
    parser.set_defaults(**{k: v for k, v in preset.items() if v != base.get(k)})
    return parser.parse_args(argv)
