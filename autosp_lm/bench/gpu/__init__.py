"""The GPU check's sections (``tools/gpu_check.py``): the CUDA paths no CPU test can run, one
module per area, each section a function ``(args, deadline) -> rows`` that runs the same code on
CPU with tiny shapes under ``--smoke``.

* ``decisive``: the recipes whose figures come first (``DECISIVE``), their job, the estimated
  cost of their cells, and their tokens/s and MFU (``throughput``);
* ``common``: a row of the table, relative errors, the worker processes, cells run in order
  (side by side, or compiled together and timed one at a time) and skipped when their estimate
  does not fit the time left;
* ``attention``: the attention-output-once pass on the SDPA kernels, the attention backward's
  workspace against the planner's formula;
* ``kernels``: ring attention's block kernels, document-masked attention;
* ``autosp_kernels``: AutoSP on the kernels a GPU run executes (SDPA's flash backend,
  FlashAttention's ``flash_attn_func`` when installed), one rank of a 2-rank job;
* ``memory_plan``: AutoSP's choice of the plan that fits ``--memory-budget-gb``, its measured
  peak against the budget;
* ``simulated``: one rank of a large SP job on one device (fake process group): step time,
  peak memory, the longest sequence that fits, the 2-D plans;
* ``plan_check``: the memory planner's prediction against the measured peak;
* ``optimizer``, ``fsdp``, ``recipes``: the fused optimizers, sharded model state, the
  hand-written strategies' memory techniques;
* ``report``: the sections in order, the table, ``gpu_check.json`` / ``.md`` after every row;
* ``worker``: the entry point of the worker processes (``python -m autosp_lm.bench.gpu.worker``).

Importing any of them needs no GPU.
"""
