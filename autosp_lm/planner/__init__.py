"""The memory planner: per-GPU peak memory and the longest trainable context, without a GPU
(``tools/plan_memory.py``; docs/plan_memory.md).

It traces a strategy's training step with the compiler on fake tensors, so it sits above
``compiler/``, ``parallel/``, ``strategies/``, ``models/`` and (its validation) ``training/``;
nothing of the package below it imports it.

* :mod:`.trace` — one rank's step compiled on fake tensors, captured; :class:`~.trace.TracedStep`
* :mod:`.depth` — depth extrapolation: a model of alike blocks traced at 2 and 3 blocks
* :mod:`.plan` — the prediction (:func:`~.plan.predict`) and the longest context that fits
* :mod:`.search` — ``tools/plan_memory.py``'s runs: each plan, the search, ``--validate``
* :mod:`.check` — the prediction validated against the measured peak of the real step
* :mod:`.capture` — the capture backend, sizes at another length, custom ops' inner peak
* :mod:`.liveness` — the simulation of the live tensors of a partitioned step
* :mod:`.workspace` — the attention kernels' own workspace per device
"""
