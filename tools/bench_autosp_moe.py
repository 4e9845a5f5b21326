#!/usr/bin/env python
"""The MoE row of tools/bench_autosp_plans.py (``--decoder moe``), kept for the commands that
docs/bench cites:

    python tools/bench_autosp_moe.py --seq-length 2048 --steps 3 --out docs/bench/cpu_moe_autosp
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_autosp_plans import main as _main  # noqa: E402


def main(argv=None):
    return _main(["--decoder", "moe", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
