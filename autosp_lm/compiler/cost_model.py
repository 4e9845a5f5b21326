"""Device parameters and the time model of the checkpointing policy (SAC).

The policy (:mod:`.passes.sac`) prices every forward node of the joint graph in *seconds* on the
device it will run on, so that recompute FLOPs, memory-bound pointwise work and re-communication
are weighed on one scale against the bytes they free:

* matmuls (``mm``/``addmm``/``bmm``/``baddbmm``): ``FLOPs / matmul_flops``;
* attention kernels (forward and backward): ``FLOPs / attention_flops``;
* collectives: ``latency + bytes on the wire / link_bw`` (all-to-all and all-gather move
  ``(P-1)/P`` of their output, reduce-scatter ``(P-1)/P`` of its input, all-reduce twice that);
* everything else (pointwise, norms, reductions, copies): ``bytes read and written / memory_bw``;
* an offloaded tensor: ``bytes / host_bw`` each way (overlapped with compute, see ``offload``).

The step's time is the sum over the whole joint graph (forward and backward); the recompute budget
is a fraction of it. Presets (:data:`DEVICES`) are sustained figures, not peaks; any field can be
overridden: ``device_params("h100-nvlink", link_bw=2e11)`` or, on the command line,
``--sac-device h100-nvlink,link_bw=2e11``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["DeviceParams", "DEVICES", "device_params", "auto_device", "collective_wire_bytes"]


@dataclass(frozen=True)
class DeviceParams:
    """Sustained rates of one device and its sequence-parallel link (SI units: FLOP/s, B/s, s)."""

    name: str
    matmul_flops: float  # dense matmul throughput
    attention_flops: float  # fused attention kernels (forward and backward)
    memory_bw: float  # device memory bandwidth, for memory-bound ops
    link_bw: float  # per-rank bandwidth of the SP group's collectives, one direction
    link_latency: float  # fixed cost of one collective
    host_bw: float  # device <-> pinned host memory (activation offload), one direction

    def with_overrides(self, **fields) -> "DeviceParams":
        bad = [k for k in fields if k not in {f.name for f in dataclasses.fields(self)}]
        if bad:
            raise ValueError(f"unknown device parameter(s) {bad}; known: "
                             + ", ".join(f.name for f in dataclasses.fields(self)))
        return dataclasses.replace(self, **{k: float(v) if k != "name" else v
                                            for k, v in fields.items()})


#: Presets. GPU figures: bf16 dense ~70% of peak for matmuls, ~45% for flash attention, 80% of
#: HBM bandwidth; NVLink 4 (900 GB/s bidirectional) ~360 GB/s per rank for an all-to-all; one
#: 400 Gb/s NIC per GPU across nodes (~45 GB/s); PCIe 5 x16 with 8 GPUs per host ~25 GB/s.
#: ``cpu`` is a 2-core x86 machine with gloo over shared memory (measured order of magnitude).
DEVICES = {
    "cpu": DeviceParams("cpu", matmul_flops=5e10, attention_flops=1.5e10, memory_bw=8e9,
                        link_bw=2e9, link_latency=1e-4, host_bw=8e9),
    "h100-nvlink": DeviceParams("h100-nvlink", matmul_flops=6.9e14, attention_flops=4.5e14,
                                memory_bw=2.7e12, link_bw=3.6e11, link_latency=1e-5,
                                host_bw=2.5e10),
    "h200-nvlink": DeviceParams("h200-nvlink", matmul_flops=6.9e14, attention_flops=4.5e14,
                                memory_bw=3.8e12, link_bw=3.6e11, link_latency=1e-5,
                                host_bw=2.5e10),
    "h100-cross-node": DeviceParams("h100-cross-node", matmul_flops=6.9e14,
                                    attention_flops=4.5e14, memory_bw=2.7e12, link_bw=4.5e10,
                                    link_latency=2.5e-5, host_bw=2.5e10),
}


def device_params(spec: Any = None, **overrides) -> DeviceParams:
    """A :class:`DeviceParams` from a preset name, ``"name,field=value,..."``, a DeviceParams or
    None (the ``cpu`` preset), with ``overrides`` applied."""
    if isinstance(spec, DeviceParams):
        base = spec
    else:
        text = (spec or "cpu").strip()
        name, *fields = [p.strip() for p in text.split(",") if p.strip()]
        if name not in DEVICES:
            raise ValueError(f"unknown SAC device {name!r}; presets: {', '.join(DEVICES)} "
                             f"(override fields with 'name,link_bw=2e11,...')")
        base = DEVICES[name]
        for f in fields:
            key, sep, value = f.partition("=")
            if not sep:
                raise ValueError(f"SAC device field {f!r} must be key=value, e.g. link_bw=2e11")
            overrides.setdefault(key.strip(), value.strip())
    return base.with_overrides(**overrides) if overrides else base


def auto_device(device: Any = None, world: int = 1,
                ranks_per_node: Optional[int] = None) -> DeviceParams:
    """The preset for ``device`` (a torch.device or its type): ``cpu``; on CUDA ``h200-nvlink``
    for an H200, else ``h100-nvlink``, and the cross-node link when the SP group is larger than
    the ranks of one node (``ranks_per_node``, default ``LOCAL_WORLD_SIZE``)."""
    kind = getattr(device, "type", device) or "cpu"
    if kind != "cuda":
        return DEVICES["cpu"]
    local = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    if world > local:
        return DEVICES["h100-cross-node"]
    try:
        import torch
        name = torch.cuda.get_device_name(getattr(device, "index", None) or 0)
    except Exception:  # noqa: BLE001 - no device: the H100 preset
        name = ""
    return DEVICES["h200-nvlink" if "H200" in name else "h100-nvlink"]


_WIRE_FACTOR = {"all_to_all": ("out", 1.0), "all_gather": ("out", 1.0),
                "reduce_scatter": ("in", 1.0), "all_reduce_sum": ("in", 2.0),
                "all_reduce_loss": ("in", 2.0), "all_reduce": ("in", 2.0)}


def collective_wire_bytes(op: str, in_bytes: float, out_bytes: float, world: int) -> float:
    """Bytes one rank sends for collective ``op`` (ring/pairwise algorithms): ``(P-1)/P`` of the
    gathered or scattered tensor, twice that for an all-reduce."""
    if world <= 1:
        return 0.0
    which, factor = _WIRE_FACTOR.get(op, ("out", 1.0))
    size = out_bytes if which == "out" else in_bytes
    return factor * size * (world - 1) / world


def node_seconds(params: DeviceParams, *, kind: str, flops: float, bytes_moved: float,
                 wire_bytes: Optional[float] = None) -> float:
    """Seconds of one node: ``kind`` is ``matmul``, ``attention``, ``collective`` or ``memory``."""
    if kind == "matmul":
        return flops / params.matmul_flops
    if kind == "attention":
        return flops / params.attention_flops
    if kind == "collective":
        return params.link_latency + (wire_bytes or 0.0) / params.link_bw
    return bytes_moved / params.memory_bw
