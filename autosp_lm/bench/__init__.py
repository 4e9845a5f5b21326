"""Measuring the strategies: the logic behind ``tools/benchmark_sp.py`` and ``tools/gpu_check.py``.

* ``names``: the benchmark's strategy names (the memory planner's, and the eager / offload /
  2-D variants) and what each one builds;
* ``options``: the command line's values turned into cells (one strategy at one length), the
  overrides of a model preset, the checks between flags;
* ``steps``: what a measuring process does, shared by the benchmark's cells and the GPU check's
  workers: a mock batch, one training step;
* ``job`` + ``cell``: one cell measured inside a (torchrun-launched) process group, and the
  worker entry point (``python -m autosp_lm.bench.cell``);
* ``launch``: one cell as a fresh job, torchrun for several ranks (a crash, OOM or timeout is a
  failed cell; a length its ranks cannot split, without a launch);
* ``harness``: the cells of a run, the interleaved timing jobs, the ``--curve`` points;
* ``fit``: the longest sequence within a memory budget (a fit on CPU, a search on CUDA);
* ``report`` + ``plots``: ``results.md``, ``curve.md``, the PNG plots, W&B;
* ``plan``: the one module that imports the memory planner;
* ``gpu/``: the GPU check's sections, one module per area.

Nothing in the core package (models, compiler, parallel, data, strategies, training) imports
this package; it imports them.
"""
