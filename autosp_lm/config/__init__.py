"""The command line and the run's configuration: everything ``pretrain.py`` and the tools read
from ``argv``.

The flags are declared here (Megatron-LM names), parsed once and checked once; the rest of the
package never sees the command line. Modules:

- ``cli``: pure argparse plumbing shared with ``tools/`` and the benchmark (flag errors as
  exceptions reported as one line, help texts that state each default once); imports nothing
  else of the package, nor torch, so that torch-free tools can use it;
- ``arguments``: ``pretrain.py``'s flags and their checks; ``checkpoint_flags``: the
  pretrained-checkpoint, tokenizer and RoPE-scaling flags; ``strategy_flags``: the strategy and
  memory flags as the strategies' option dataclasses;
- ``preflight``: the checks that need no model and no data (files, ``--load``, CUDA, wandb);
- ``plan_command``: a memory plan's ``pretrain.py`` command, read back through the same flags.

This ``__init__`` imports nothing, so that ``autosp_lm.config.cli`` stays cheap.
"""
