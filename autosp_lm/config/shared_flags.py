"""The flags ``pretrain.py`` and the tools share, declared once: ``--model``,
``--model-overrides``, ``--seq-length``, the parallel sizes (``--sequence-parallel-size`` /
``--context-parallel-size``, ``--ulysses-degree``), ``--bf16`` and
``--fp32-residual-connection``.

Each ``add_*`` function takes the parser (or argument group) and what differs between callers
(the default, the help text; a tool's own name of a parallel size, e.g. ``--nproc``) and declares
the flag with the one type and the one check: the same value parses to the same value of the same
type everywhere, and a bad value is the same one-line error, ``pretrain.py``'s (argparse's
``choices`` for ``--model``, :func:`~autosp_lm.config.cli.positive_int` for the sizes).
:func:`parse_model_overrides` reads ``--model-overrides`` (``key=value,...`` or a JSON object).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Callable, Optional, Sequence

from ..models.config import PRESETS, ModelConfig
from .cli import ArgumentError, parse_overrides, positive_int

#: the names of ``pretrain.py``'s sequence-parallel size (Megatron's context-parallel alias too)
SP_FLAGS = ("--sequence-parallel-size", "--context-parallel-size")
#: ``--model``'s values, as its help lists them
MODELS = tuple(sorted(PRESETS))


class _Checked(argparse.Action):
    """Stores the value; ``check(flag, value)`` returns why the value is refused (then the parse
    ends with that one line, ``parser.error``) or None."""

    def __init__(self, option_strings, dest, check: Callable = None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.check = check

    def __call__(self, parser, namespace, values, option_string=None):
        problem = self.check(option_string or self.option_strings[0], values)
        if problem:
            parser.error(problem)
        setattr(namespace, self.dest, values)


def _overrides(flag: str, value: str) -> Optional[str]:
    try:
        parse_model_overrides(value)
    except ArgumentError as e:
        return str(e)
    return None


def add_model(parser, default: str,
              help: str = "named model shape; individual shape flags below override it"):
    """``--model NAME``: one of the presets (``models.config.PRESETS``), listed in the help."""
    return parser.add_argument("--model", default=default, choices=MODELS, help=help)


def add_model_overrides(parser, default: str = "",
                        help: str = "shape overrides of the preset: key=value,... (e.g. "
                                    "num_layers=4,hidden_size=512) or a JSON object"):
    """``--model-overrides`` (the tools): the preset's fields to change, kept as given (the
    text); checked as it is parsed, read with :func:`parse_model_overrides`."""
    return parser.add_argument("--model-overrides", default=default, action=_Checked,
                               check=_overrides, help=help)


def parse_model_overrides(text) -> dict:
    """``--model-overrides``: a JSON object when the text starts with ``{``, else ``key=value,...``
    (:func:`~autosp_lm.config.cli.parse_overrides`: an int, else a float, else the string); empty
    or None: none. Every key must be a field of :class:`~autosp_lm.models.config.ModelConfig`.
    Raises :class:`~autosp_lm.config.cli.ArgumentError` naming the problem."""
    text = (text or "").strip()
    if text.startswith("{"):
        try:
            out = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArgumentError(f"--model-overrides {text!r} is not valid JSON ({e.msg}); give "
                                f"a JSON object or key=value,...") from None
        if not isinstance(out, dict):
            raise ArgumentError(f"--model-overrides {text!r}: give a JSON object or key=value,...")
    else:
        out = parse_overrides(text)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = sorted(set(out) - fields)
    if bad:
        raise ArgumentError(f"--model-overrides: unknown key {', '.join(bad)}; the keys are the "
                            f"model config's fields: {', '.join(sorted(fields))}")
    return out


def add_seq_length(parser, default: int, help: str = "tokens per sample"):
    """``--seq-length N``: a positive integer."""
    return parser.add_argument("--seq-length", type=positive_int, default=default, help=help)


def add_sequence_parallel_size(parser, default: Optional[int] = None,
                               help: str = "sequence-parallel size",
                               flags: Sequence[str] = SP_FLAGS, dest: Optional[str] = None):
    """The sequence-parallel size (ranks that split one sequence): a positive integer, under
    ``pretrain.py``'s names (:data:`SP_FLAGS`) unless a tool has its own (``flags``)."""
    dest = dest or flags[0].lstrip("-").replace("-", "_")
    return parser.add_argument(*flags, dest=dest, type=positive_int, default=default, help=help)


def add_ulysses_degree(parser, default: Optional[int] = None,
                       help: str = "ranks of the all-to-all over heads (P = U x R)"):
    """``--ulysses-degree U``: a positive integer (the rest of the SP size is a ring)."""
    return parser.add_argument("--ulysses-degree", type=positive_int, default=default, help=help)


def add_bf16(parser, help: str = "Megatron-style bf16 (bf16 parameters for compute, fp32 main "
                                 "weights)"):
    """``--bf16``: a switch."""
    return parser.add_argument("--bf16", action="store_true", help=help)


def add_fp32_residual_connection(parser, help: str = "with --bf16: fp32 parameters and "
                                                     "residual, bf16 inside autocast only"):
    """``--fp32-residual-connection``: a switch (meaningful with ``--bf16``)."""
    return parser.add_argument("--fp32-residual-connection", action="store_true", help=help)


__all__ = ["SP_FLAGS", "MODELS", "add_model", "add_model_overrides", "parse_model_overrides",
           "add_seq_length", "add_sequence_parallel_size", "add_ulysses_degree", "add_bf16",
           "add_fp32_residual_connection"]
