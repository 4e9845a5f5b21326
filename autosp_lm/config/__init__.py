"""The command line and the run's configuration: everything ``pretrain.py`` and the tools read
from ``argv``, parsed once.

Flow: ``argv`` -> :func:`.arguments.parse_args` (the flags, Megatron-LM names, declared once;
``--recipe NAME`` presets them) -> :func:`.build.build_run_config` (every check, once; returns
values, never writes into the namespace) -> the frozen :class:`.run_config.RunConfig`, whose
parts (model, parallel layout, strategy options, data, training) go to the rooms that read them.
Nothing outside this package reads the namespace. Modules:

- ``cli``: pure argparse plumbing shared with ``tools/`` and the benchmark (flag errors as
  exceptions reported as one line, help texts that state each default once); imports nothing
  else of the package, nor torch, so that torch-free tools can use it;
- ``arguments``: ``pretrain.py``'s flags; ``checkpoint_flags``: the pretrained-checkpoint,
  tokenizer and RoPE-scaling flags; ``shared_flags``: the flags the tools share with
  ``pretrain.py``; ``recipe_flags``: a named recipe as flags;
- ``build``: the checks and the :class:`RunConfig` they return; ``strategy_flags``: the
  strategy and memory flags as the strategies' option dataclasses; ``run_config``: the typed
  configuration and its stored form (checkpoints);
- ``preflight``: the checks that need no model and no data (files, ``--load``, CUDA, wandb);
- ``plan_command`` / ``plan_report``: a memory plan's ``pretrain.py`` command, read back
  through the same checks, and the planner tool's report.

This ``__init__`` imports nothing, so that ``autosp_lm.config.cli`` stays cheap.
"""
