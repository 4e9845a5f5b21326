"""The flags pretrain.py shares with the tools (autosp_lm/config/shared_flags.py) parse through
the same code: the same values give the same namespace values of the same types in pretrain's
parser and in a tool's, a bad value is the same one-line error in both, and --model-overrides
reads a JSON object and key=value,... alike. Parsing only: no model is built, nothing traced."""
from __future__ import annotations

import os
import sys

import pytest

from autosp_lm.config import cli
from autosp_lm.config.arguments import build_parser as pretrain_parser
from autosp_lm.config.shared_flags import parse_model_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
try:
    import benchmark_sp  # noqa: E402
    import plan_memory  # noqa: E402
finally:
    sys.path.remove(os.path.join(ROOT, "tools"))

SHARED = ("model", "seq_length", "bf16", "sequence_parallel_size")

ALIKE = [
    ["--model", "gpt-tiny", "--seq-length", "4096", "--bf16", "--sequence-parallel-size", "4"],
    ["--model", "llama-3.2-1b", "--seq-length", "131072", "--context-parallel-size", "8"],
    ["--model", "llama-tiny", "--seq-length", "1", "--sequence-parallel-size", "1", "--bf16"],
]


@pytest.mark.parametrize("argv", ALIKE, ids=" ".join)
def test_the_same_values_parse_alike(argv):
    ours = vars(pretrain_parser().parse_args(argv))
    tool = vars(plan_memory.build_parser().parse_args(argv))
    for dest in SHARED:
        assert ours[dest] == tool[dest] and type(ours[dest]) is type(tool[dest]), dest


#: pretrain.py's own wording of each refusal (as before the flags were shared: "nothing a
#: user sees changes"); the tools now give the same
BAD = [
    (["--model", "llama-99b"], "argument --model: invalid choice: 'llama-99b' (choose from "
                               "'gpt-tiny', 'gpt2-124m'"),
    (["--seq-length", "0"], "argument --seq-length: must be a positive integer, got 0"),
    (["--seq-length", "-5"], "argument --seq-length: must be a positive integer, got -5"),
    (["--seq-length", "4k"], "argument --seq-length: expected an integer, got '4k'"),
    (["--sequence-parallel-size", "0"], "argument --sequence-parallel-size/--context-parallel-size: "
                                        "must be a positive integer, got 0"),
    (["--context-parallel-size", "-2"], "argument --sequence-parallel-size/--context-parallel-size: "
                                        "must be a positive integer, got -2"),
    (["--bf16=yes"], "argument --bf16: ignored explicit argument 'yes'"),
]


def _refusal(parser, argv) -> str:
    with pytest.raises(cli.UsageError) as e:
        parser.parse_args(argv)
    text = str(e.value)
    assert text.endswith(f"(`python {parser.prog} --help` lists the flags)") and "\n" not in text
    return text[:text.rindex(" (`python")]


@pytest.mark.parametrize("argv,text", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_the_same_error(argv, text):
    ours = _refusal(pretrain_parser(), argv)
    assert ours == _refusal(plan_memory.build_parser(), argv)
    assert ours.startswith(text), ours


def test_a_tool_name_of_the_sp_size_is_checked_alike(capsys):
    """benchmark_sp.py keeps its --nproc (plain argparse: usage and exit status 2), checked as
    pretrain.py's --sequence-parallel-size."""
    assert benchmark_sp.parse_args(["--nproc", "4"]).nproc == 4
    with pytest.raises(SystemExit) as e:
        benchmark_sp.parse_args(["--nproc", "0"])
    assert e.value.code == 2
    assert "error: argument --nproc: must be a positive integer, got 0" in capsys.readouterr().err


def test_json_and_key_value_overrides_parse_equal():
    kv = "num_layers=2,hidden_size=128,rotary_base=500000.5,arch=llama"
    js = '{"num_layers": 2, "hidden_size": 128, "rotary_base": 500000.5, "arch": "llama"}'
    assert parse_model_overrides(kv) == parse_model_overrides(js) == {
        "num_layers": 2, "hidden_size": 128, "rotary_base": 500000.5, "arch": "llama"}
    assert parse_model_overrides("") == parse_model_overrides("{}") == \
        parse_model_overrides(None) == {}
    # JSON reaches what key=value cannot: a nested value
    assert parse_model_overrides('{"rope_scaling": {"factor": 8.0}}') == {
        "rope_scaling": {"factor": 8.0}}


@pytest.mark.parametrize("text,error", [
    ("num_layer=2", "unknown key num_layer"),
    ('{"num_layer": 2}', "unknown key num_layer"),
    ("num_layers", "'num_layers' must be key=value"),
    ('{"num_layers": 2', "is not valid JSON"),
    ('{"num_layers": 2} x', "is not valid JSON"),
])
def test_bad_overrides_are_refused(text, error):
    with pytest.raises(cli.ArgumentError, match=error):
        parse_model_overrides(text)


def test_overrides_are_checked_as_they_are_parsed_and_kept_as_given():
    """A tool's --model-overrides refuses a bad value while parsing (one line) and keeps the text
    as given (its JSON report records the flags as typed)."""
    p = plan_memory.build_parser()
    assert p.parse_args(["--model-overrides", '{"num_layers": 1}']).model_overrides == \
        '{"num_layers": 1}'
    assert "unknown key num_layer" in _refusal(p, ["--model-overrides", "num_layer=1"])
