"""The einops inlining pass: on torch 2.10/2.11 Dynamo keeps einops' rearrange/reduce/repeat as
opaque calls (einops 0.8 registers them allow_in_graph); the pass replaces them with the tensor
methods derived from the pattern. Checked here on hand-built graphs against einops itself (the
whole AutoSP path on torch 2.11 is the gpt2-style parity case, run with /work/venv211)."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

einops = pytest.importorskip("einops")

from autosp_lm.compiler.passes.inline_einops import inline_einops  # noqa: E402

CASES = [
    ("rearrange", "b s (three h d) -> three b h s d", dict(three=3, h=2), None, (2, 6, 24)),
    ("rearrange", "b h s d -> b s (h d)", {}, None, (2, 3, 6, 4)),
    ("rearrange", "(b s) d -> b s d", dict(b=2), None, (12, 24)),
    ("rearrange", "b ... d -> b d ...", {}, None, (2, 3, 4, 5)),
    ("rearrange", "b s 1 d -> b s () d", {}, None, (2, 3, 1, 5)),
    ("reduce", "b s (h d) -> b h", dict(h=4), "mean", (2, 6, 24)),
    ("reduce", "b s d -> b d", {}, "max", (2, 6, 24)),
    ("repeat", "b h s d -> b (h r) s d", dict(r=3), None, (2, 2, 6, 4)),
    ("repeat", "h d -> b h d", dict(b=3), None, (2, 4)),
]


def _graph(op, pattern, lengths, reduction, x):
    g = fx.Graph()
    p = g.placeholder("x")
    p.meta["example_value"] = x
    fn = getattr(einops, op)
    args = (p, pattern) + ((reduction,) if op == "reduce" else ())
    out = g.call_function(fn, args, lengths)
    out.meta["example_value"] = fn(x, *args[1:], **lengths)
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g), fn


@pytest.mark.parametrize("op,pattern,lengths,reduction,shape", CASES, ids=[c[1] for c in CASES])
def test_inlined_equals_einops(op, pattern, lengths, reduction, shape):
    x = torch.randn(shape)
    gm, fn = _graph(op, pattern, lengths, reduction, x)
    assert inline_einops(gm) == 1
    assert not [n for n in gm.graph.nodes if n.target is fn]
    want = fn(x, pattern, reduction, **lengths) if reduction else fn(x, pattern, **lengths)
    assert torch.equal(gm(x), want)
    last = list(gm.graph.nodes)[-2]
    assert last.meta["example_value"].shape == want.shape


def test_unknown_reduction_stays():
    x = torch.randn(2, 6, 4) > 0
    gm, fn = _graph("reduce", "b s d -> b d", {}, "any", x)
    assert inline_einops(gm) == 0  # left to the sharding pass's fallback, which names it
    assert [n for n in gm.graph.nodes if n.target is fn]
