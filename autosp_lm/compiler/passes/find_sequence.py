"""Graph pass — find the sequence.

Expects: the Dynamo graph of the whole model (torch-function level) traced with the sequence
dimension of every sequence input marked dynamic by :func:`~autosp_lm.compiler.autosp_compile` (all other dimensions
static), so the global sequence length is a sympy symbol ``S`` in the placeholders' example values.

Rewrites: nothing.

Afterwards: :class:`SequenceInfo` names the sequence placeholders with their sequence dimension,
the canonical symbol of ``S`` (other symbols Dynamo gave the same length are aliases of it), and a
graph value holding ``S`` at run time (a lifted SymInt placeholder when Dynamo made one).
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from ..graph import AutoSPError, SequenceInfo, example, to_expr


def display_name(node: fx.Node) -> str:
    name = str(node.target)
    for prefix in ("L_kwargs_", "L_args_", "L_"):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name.rstrip("_") or name


def specialized_length(gm: fx.GraphModule):
    """When Dynamo turned a marked sequence length into a constant while tracing: the error text
    naming the input and the model line where it happened (the shape environment's record of
    the first such replacement); else None."""
    for node in gm.graph.find_nodes(op="placeholder"):
        ev = example(node)
        env = getattr(getattr(ev, "fake_mode", None), "shape_env", None)
        if env is not None:
            break
    else:
        return None
    sources = getattr(env, "var_to_sources", {})
    for sym, value in getattr(env, "replacements", {}).items():
        if not (getattr(value, "is_Integer", False) and sources.get(sym)):
            continue
        name = sources[sym][0].name  # e.g. L['input_ids'].size()[1]
        name = name.split("'")[1] if name.count("'") >= 2 else name
        loc = getattr(getattr(env, "replacements_slocs", {}).get(sym), "maybe_user_loc", None)
        at = f" at `{loc.split('  # ')[0].strip()}` ({loc.split('  # ')[-1]})" if loc else ""
        return (f"AutoSP: the sequence length of input {name} became the constant {value} while "
                f"Dynamo traced the model{at}: an op before that line returned a length that is "
                f"not symbolic (torch's associative_scan does; so does Python arithmetic on the "
                f"length), and AutoSP plans for a symbolic length. Fix: write the scan with "
                f"cumsum / cumprod / logcumsumexp / cummax / cummin over the sequence, which "
                f"AutoSP shards exactly (a local scan on each rank and an exclusive scan of the "
                f"per-rank totals); a linear recurrence h_t = a_t * h_(t-1) + b_t can be written "
                f"in log space with cumsum and logcumsumexp")
    return None


def find_sequence(gm: fx.GraphModule, *, world: int, rank: int, group: str) -> SequenceInfo:
    inputs, symbols, shape_env = {}, [], None
    seq_placeholder, seq_dim = None, 1
    for node in gm.graph.find_nodes(op="placeholder"):
        ev = example(node)
        if not isinstance(ev, torch.Tensor):
            continue
        dyn = [(i, to_expr(s)) for i, s in enumerate(ev.shape) if not to_expr(s).is_Integer]
        if not dyn:
            continue
        for d, expr in dyn:
            if not isinstance(expr, sympy.Symbol):
                raise AutoSPError(f"AutoSP: the sequence size of input {display_name(node)} is "
                                  f"{expr}, expected a plain length")
        dim, expr = dyn[0]
        shape_env = shape_env or getattr(getattr(ev, "fake_mode", None), "shape_env", None)
        inputs[display_name(node)] = [d for d, _ in dyn]
        symbols += [e for _, e in dyn]
        if seq_placeholder is None:
            seq_placeholder, seq_dim = node, dim
    if not symbols:
        raise AutoSPError(specialized_length(gm) or (
            "AutoSP found no sequence input: pass input_ids/labels/position_ids/"
            "attention_mask by name or mark one with mark_sequence(tensor, dim)"))
    if shape_env is not None:  # Dynamo may already know that two inputs share a length
        symbols = [shape_env.replace(s) if hasattr(shape_env, "replace") else s for s in symbols]
    symbol = symbols[0]
    aliases = {s: symbol for s in symbols[1:] if s != symbol}
    sym_placeholder = None
    for node in gm.graph.find_nodes(op="placeholder"):
        ev = example(node)
        if isinstance(ev, torch.SymInt):
            expr = to_expr(ev)
            if shape_env is not None and hasattr(shape_env, "replace"):
                expr = shape_env.replace(expr)
            if expr.xreplace(aliases) == symbol:
                sym_placeholder = node
                break
    return SequenceInfo(symbol=symbol, aliases=aliases, inputs=inputs,
                        sym_placeholder=sym_placeholder, seq_placeholder=seq_placeholder,
                        seq_dim=seq_dim, world=world, rank=rank, group=group, shape_env=shape_env)
