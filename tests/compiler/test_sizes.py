"""How the sharding pass reads symbolic sizes (``SequenceInfo.canon``): exact divisions and
remainders are rewritten, bottom-up, only where they are exact for the traced length, and each
assumption about the length is recorded as the multiple of ``S`` it needs."""
from __future__ import annotations

import pytest
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._sympy.functions import FloorDiv, Mod

from autosp_lm.compiler.graph import SequenceInfo


def _info(length):
    env = ShapeEnv()
    s = env.create_symbol(length, ConstantSource("S"), dynamic_dim=DimDynamic.DYNAMIC)
    return SequenceInfo(symbol=s, aliases={}, inputs={}, sym_placeholder=None,
                        seq_placeholder=None, shape_env=env), s


def test_a_padding_to_a_multiple_is_zero_when_the_length_is_one():
    info, s = _info(16)
    assert info.canon(Mod(4 - Mod(s, 4), 4)) == 0  # transformers' Mamba-2 pad_size
    assert info.canon(s + Mod(4 - Mod(s, 4), 4)) == s  # the padded length
    assert info.assumed_multiples == {4}


def test_chunk_count_and_chunk_length_read_exactly():
    info, s = _info(16)
    assert info.canon(4 * FloorDiv(s, 4)) == s  # einops' merge of "(c l)"
    assert info.canon(FloorDiv(s, FloorDiv(s, 4))) == 4  # reshape(-1, 4)'s inferred chunk
    assert info.assumed_multiples == {4}


@pytest.mark.parametrize("expr,multiple", [
    (lambda s: Mod(2 * s, 4), 2),      # 2S % 4 == 0 needs only S even
    (lambda s: Mod(s + 8, 4), 4),      # a constant multiple of 4 changes nothing
])
def test_each_assumption_records_the_multiple_it_needs(expr, multiple):
    info, s = _info(16)
    assert info.canon(expr(s)) == 0
    assert info.assumed_multiples == {multiple}


def test_divisions_that_are_not_exact_stay_whole():
    info, s = _info(16)
    assert info.canon(FloorDiv(s, 3)) == FloorDiv(s, 3)  # 16 is not a multiple of 3
    assert info.canon(FloorDiv(2 * s + 1, 4)) == FloorDiv(2 * s + 1, 4)  # odd: never exact
    info, s = _info(18)
    assert info.canon(Mod(s, 4)) == Mod(s, 4)
    assert not info.assumed_multiples


def test_the_reading_does_not_depend_on_the_order_of_calls():
    """Ranks iterate sets in different orders: the same expression must read the same whatever
    was read before it (ShapeEnv.simplify's cache did not, and ranks planned differently)."""
    exprs = [lambda s: 4 * FloorDiv(s, 4), lambda s: FloorDiv(s, FloorDiv(s, 4)),
             lambda s: s + Mod(4 - Mod(s, 4), 4), lambda s: FloorDiv(s, 3)]
    forward, s1 = _info(16)
    backward, s2 = _info(16)
    a = [forward.canon(e(s1)).xreplace({s1: s2}) for e in exprs]
    b = [backward.canon(e(s2)) for e in reversed(exprs)][::-1]
    assert a == b
