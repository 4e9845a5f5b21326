"""The GPU check's worker processes: ``python -m autosp_lm.bench.gpu.worker CELL_JSON OUT_PATH``
runs the worker ``CELL_JSON["worker"]`` names (the simulated SP job by default) and writes its
result as JSON to ``OUT_PATH`` (:func:`common.run_worker` starts them)."""
from __future__ import annotations

import json
import sys

from .autosp_kernels import kernels_worker
from .decisive import throughput_worker
from .fsdp import WORKERS as FSDP_WORKERS
from .memory_plan import memory_plan_worker
from .plan_check import plan_worker
from .simulated import simulated_worker

WORKERS = dict(FSDP_WORKERS, plan=plan_worker, throughput=throughput_worker,
               autosp_kernels=kernels_worker, memory_plan=memory_plan_worker)


def main(argv: list) -> None:
    cell = json.loads(argv[0])
    out = WORKERS.get(cell.get("worker"), simulated_worker)(cell)
    with open(argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1:])
