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
        raise AutoSPError("AutoSP found no sequence input: pass input_ids/labels/position_ids/"
                          "attention_mask by name or mark one with mark_sequence(tensor, dim)")
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
