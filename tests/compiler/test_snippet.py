"""The source line the AutoSP report quotes: cut at a word boundary, brackets closed in order."""
import pytest

from autosp_lm.compiler.graph import clean_snippet


@pytest.mark.parametrize("line,shown", [
    ("x = a + b", "x = a + b"),
    ("out = f(x,", "out = f(x, ...)"),  # a statement continued on the next line
    ("y = torch.cat([a, b,", "y = torch.cat([a, b, ...])"),
    ("q = self.q(", "q = self.q(...)"),
    ('d = {"a": x,', 'd = {"a": x, ...}'),
    ('s = "(" + x', 's = "(" + x'),  # brackets inside strings are text
    ("return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)",
     "return F.scaled_dot_product_attention(q, k, v, is_causal=causal, ...)"),
])
def test_snippets_end_cleanly(line, shown):
    assert clean_snippet(line) == shown
    assert len(clean_snippet(line * 3)) <= 90 and not clean_snippet(line * 3).endswith((",", ":"))
