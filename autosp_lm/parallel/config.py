"""The parallel part of a run's configuration: the layout (world = data-parallel x
sequence-parallel, the Ulysses degree of a 2-D plan), where the model state lives (FSDP2, the
distributed optimizer), and the process groups' backend, device and timeout. Built once from
the command line by :mod:`autosp_lm.config`; :func:`autosp_lm.parallel.init_parallel` takes its
fields."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1
    sequence_parallel_size: int = 1
    data_parallel_size: int = 1
    ulysses_degree: Optional[int] = None  # None: the strategy's choice
    use_torch_fsdp2: bool = False
    use_distributed_optimizer: bool = False
    distributed_backend: Optional[str] = None  # None: nccl on CUDA, gloo on CPU
    device: str = "auto"
    distributed_timeout_minutes: float = 30

    @property
    def sharded(self) -> bool:
        """Whether the model state is sharded (FSDP2 or the distributed optimizer)."""
        return self.use_torch_fsdp2 or self.use_distributed_optimizer


__all__ = ["ParallelConfig"]
