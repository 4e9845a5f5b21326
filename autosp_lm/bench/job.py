"""One strategy built for a benchmark cell inside this (torchrun-launched) process group, and
the memory measurements of its steps."""
from __future__ import annotations

import os

from .names import strategy_spec
from .steps import mock_batch, train_step


def measure_peak(device, fn):
    """Peak memory of ``fn()``: on CUDA the absolute ``max_memory_allocated`` (weights and
    optimizer state included: what must fit in the budget), on CPU the peak resident set during the
    call minus the resident set before it (``/proc/self/clear_refs``)."""
    import torch
    from autosp_lm.training.memory import peak_rss_delta
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_delta(fn)[1]


def measure_live_peak(device, fn):
    """Peak of live tensor memory during ``fn()`` above what was live before it
    (:class:`~autosp_lm.training.memory.LivePeak`: exact on CPU from the allocator's profiler
    events, ``max_memory_allocated - memory_allocated`` on CUDA): activations, gradients and
    transients of the step, not the weights and optimizer state that were live before it."""
    from autosp_lm.training.memory import LivePeak
    with LivePeak(device) as lp:
        fn()
    return lp.peak


def packed_batch(cell: dict):
    """``(batch, padded vocabulary)``: the first micro batch of the built-in corpus (Python
    standard library sources: documents end inside samples) with document ids, positions that
    restart per document and the loss masked after end-of-document tokens."""
    import torch
    from autosp_lm.models.config import pad_vocab
    from autosp_lm.data import DataConfig, build_data
    config = DataConfig(seq_length=cell["seq_length"], seed=cell["seed"], eod_mask_loss=True,
                        reset_position_ids=True, reset_attention_mask=True)
    n = cell["micro_batch_size"]
    data = build_data(config, (n, 0, 0), mock_vocab_size=0)
    batch = {k: torch.stack([data.train[i][k] for i in range(n)])
             for k in ("input_ids", "labels", "position_ids", "document_ids")}
    return batch, pad_vocab(data.vocab_size, 128)


def init_process(cell: dict) -> None:
    """This process's threads and, for a simulated world, its fake process group."""
    import torch
    torch.set_num_threads(max(1, int(cell.get("threads") or torch.get_num_threads())))
    if cell.get("simulate_world_size"):
        from autosp_lm.parallel.state import init_simulated_world
        init_simulated_world(cell["simulate_world_size"])


class Job:
    """One strategy built for a cell inside this (torchrun-launched) process group: its model,
    optimizer and batch, and :meth:`step` (a training step: forward, backward, optimizer)."""

    def __init__(self, cell: dict):
        import torch
        import torch.distributed as dist
        from autosp_lm.models import build_model, preset_config
        from autosp_lm.parallel.sharding_kinds import build_sharding
        from autosp_lm.parallel.state import init_parallel
        from autosp_lm.strategies import build_strategy
        from autosp_lm.training.flops import document_attention_pairs
        from autosp_lm.training.optimizer import build_optimizer

        reg_name, options = strategy_spec(cell["strategy"])
        world = (dist.get_world_size() if dist.is_initialized()
                 else int(os.environ.get("WORLD_SIZE", "1")))
        self.world, self.sp = world, (world if reg_name != "none" else 1)
        self.ps = ps = init_parallel(self.sp, device=cell["device"])
        seq = cell["seq_length"]
        packed = packed_batch(cell) if cell.get("packed") else None
        over = dict(cell.get("overrides") or {})
        if packed:
            over["vocab_size"] = packed[1]
        cfg = preset_config(cell["model"], **over)
        self.cfg = cfg = preset_config(cell["model"], **dict(
            over, max_position_embeddings=max(seq, cfg.max_position_embeddings)))
        torch.manual_seed(cell["seed"])
        self.model = model = build_model(cfg).to(ps.device)
        self.strategy = build_strategy(reg_name, ps, **cell_options(cell, reg_name, options))
        # --bf16 is Megatron-style (bf16 parameters, fp32 main ones); --fp32-residual-connection
        # keeps fp32 parameters under autocast (autosp_lm/parallel/precision.py)
        self.sharding = build_sharding("none", ps, bf16=cell["bf16"],
                                       fp32_residual=cell.get("fp32_residual", False))
        self.sharding.wrap(model)
        self.strategy.setup(model)
        self.optimizer = build_optimizer(self.sharding.optimizer_module(), lr=1e-4,
                                         weight_decay=0.0, device=ps.device)
        if packed:
            self.batch = {k: v.to(ps.device) for k, v in packed[0].items()}
        else:
            self.batch = mock_batch(cfg.vocab_size, seq, cell["micro_batch_size"], cell["seed"],
                                    ps.device, keys=("input_ids", "labels", "position_ids"))
        self.pairs = (document_attention_pairs(self.batch["document_ids"])
                      if "document_ids" in self.batch else None)
        self.bf16 = cell["bf16"]

    def step(self, measure_saved=False, zero=True):
        from autosp_lm.training.memory import SavedTensorBytes
        counter = SavedTensorBytes(exclude=self.model) if measure_saved else None
        reported = train_step(self.strategy, self.model, self.optimizer, self.batch,
                              bf16=self.bf16, device=self.ps.device, dp_size=self.ps.dp_size,
                              sharding=self.sharding, zero=zero, saved_counter=counter)
        return float(reported), counter


def cell_options(cell: dict, reg_name: str, options: dict) -> dict:
    """The strategy's options for a cell: its code generation, and for AutoSP the cell's SAC
    budget, memory target and activation offload."""
    backend = cell.get("compile_backend", "inductor")
    if reg_name == "autosp":
        return dict(options, backend=backend, verbose=False,
                    **({"sac_budget": cell["sac_budget"]} if cell.get("sac_budget") else {}),
                    **({"sac_memory_target": cell["sac_memory_target"]}
                       if cell.get("sac_memory_target") is not None else {}),
                    **({"offload_activations": True} if cell.get("offload") else {}))
    if options.get("compile"):
        return dict(options, backend=backend)
    return options
