"""Every tool's --help: each flag has a help text and states its default at most once."""
import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the tools are the scripts (a module like gpu_check_fsdp.py is a part of one, imported by it)
TOOLS = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "tools")) if f.endswith(".py")
               and 'if __name__ == "__main__"' in open(os.path.join(ROOT, "tools", f)).read())


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_flag_has_help(tool, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        module = __import__(tool)
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))

    def capture(self, *args, **kwargs):  # the tool's parser, before it parses anything
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed) as got:
        (getattr(module, "parse_args", None) or module.main)([])
    parser = got.value.args[0]
    formatter = parser._get_formatter()
    for action in parser._actions:
        assert action.help, f"{tool} {action.option_strings}: no help text"
        text = formatter._expand_help(action)
        assert text.count("default") <= 1 and "(default: None)" not in text, f"{tool}: {text}"
