"""``pretrain.py`` with AutoSP's early head-count check switched off, so that the compiler itself
meets the refusal during the first step: how every refusal that only the compiler can find (an
op it cannot shard exactly, a graph break) reaches the user. Run it like pretrain.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from autosp_lm.strategies.autosp import AutoSPStrategy  # noqa: E402

AutoSPStrategy.check = classmethod(lambda cls, *args: None)

import pretrain  # noqa: E402

if __name__ == "__main__":
    sys.exit(pretrain.exit_status(pretrain.main()))
