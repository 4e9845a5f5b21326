"""Command-line plumbing shared by ``pretrain.py`` and ``tools/``: flag errors as exceptions
(reported once, as one line, by the caller) and help texts that state every default once.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` to every flag: ``(default:
None)`` where the default is computed elsewhere, ``(default: False)`` on every switch, and a second
default where the help already explains it. :class:`HelpFormatter` appends it only where it says
something. Pure argparse: tools that must not import torch can use it.
"""
from __future__ import annotations

import argparse


class ArgumentError(ValueError):
    """An invalid flag or flag combination; the message names the flag and the fix."""

    exit_code = 1


class UsageError(ArgumentError):
    """What argparse itself refuses (an unknown flag, a value of the wrong type); exit status 2,
    as argparse's own."""

    exit_code = 2


class Parser(argparse.ArgumentParser):
    """Raises :class:`UsageError` instead of printing the whole usage and exiting (on every rank of
    a distributed job), so that the caller reports it like every other error."""

    def error(self, message):
        raise UsageError(f"{message} (`python {self.prog} --help` lists the flags)")


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` only where a flag has a default worth printing and its help does
    not state one already (no ``(default: None)``, no doubled defaults, nothing for switches)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or \
                action.default == argparse.SUPPRESS or not action.option_strings or action.nargs == 0:
            return text
        return text + " (default: %(default)s)"


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`HelpFormatter` that keeps the description's own line breaks (a module docstring)."""


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_overrides(text) -> dict:
    """``--model-overrides``: ``key=value,...`` (empty or None: none); each value an int, else
    a float, else the string. Raises :class:`ArgumentError` for an item without ``=``."""
    out = {}
    for kv in filter(None, (x.strip() for x in (text or "").split(","))):
        key, sep, value = kv.partition("=")
        if not sep:
            raise ArgumentError(f"--model-overrides {kv!r} must be key=value")
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


__all__ = ["ArgumentError", "UsageError", "Parser", "HelpFormatter", "RawDescriptionHelpFormatter",
           "positive_int", "nonneg_int", "parse_overrides"]
