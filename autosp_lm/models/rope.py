"""Rotary position embeddings: inverse frequencies, scaling for context extension, cos/sin tables.

A RoPE model rotates each pair ``(x[i], x[i + d/2])`` of a query/key head of size ``d`` by the
angle ``position * inv_freq[i]`` with ``inv_freq[i] = base ** (-2 i / d)``. Extending the context
of a pretrained model changes these frequencies (and, for YaRN, the magnitude of the tables):

===============  =================================================================================
``none``         plain RoPE
``linear``       position interpolation: every frequency divided by ``factor``
``dynamic-ntk``  NTK-aware growth of the base with the sequence: for a sequence of ``s`` tokens longer
                 than ``original_max_position_embeddings`` (``L0``) the base becomes
                 ``base * (factor * s / L0 - (factor - 1)) ** (d / (d - 2))``; plain RoPE up to
                 ``L0``. ``s`` is the length of the batch the model sees.
``llama3``       Llama-3.1's split: wavelengths longer than ``L0 / low_freq_factor`` are divided
                 by ``factor``, shorter than ``L0 / high_freq_factor`` kept, a smooth blend
                 in between
``yarn``         YaRN (arXiv 2309.00071): dimensions that rotate more than ``beta_fast`` times over
                 ``L0`` tokens keep their frequency, fewer than ``beta_slow`` times are divided by
                 ``factor``, a linear ramp between (over the dimension index); and cos/sin are
                 multiplied by the attention factor (default ``0.1 ln(factor) + 1``), which scales
                 the attention logits by its square.
===============  =================================================================================

A scaling is a dict with ``rope_type`` and the parameters of that type, under the key names the
Hugging Face configs use (``factor``, ``original_max_position_embeddings``, ``low_freq_factor``,
``high_freq_factor``, ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``,
``mscale_all_dim``, ``truncate``). :func:`normalize_rope_scaling` checks one and fills defaults;
a missing, unknown or out-of-range parameter is a :class:`RopeScalingError` naming it.

Frequencies are computed in float64 and rounded once to float32 (transformers computes them in
float32, so the two agree to a few float32 ulps).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

ROPE_TYPES = ("none", "linear", "dynamic-ntk", "llama3", "yarn")

# flag that sets each parameter (for error messages)
PARAM_FLAGS = {
    "factor": "--rope-scaling-factor",
    "original_max_position_embeddings": "--rope-original-max-position-embeddings",
    "low_freq_factor": "--rope-low-freq-factor",
    "high_freq_factor": "--rope-high-freq-factor",
    "beta_fast": "--yarn-beta-fast",
    "beta_slow": "--yarn-beta-slow",
    "attention_factor": "--yarn-attention-factor",
    "mscale": None,
    "mscale_all_dim": None,
    "truncate": None,
}

# rope_type -> (required parameters, optional parameters with their defaults)
_PARAMS: dict[str, tuple[tuple[str, ...], dict]] = {
    "linear": (("factor",), {}),
    "dynamic-ntk": (("factor", "original_max_position_embeddings"), {}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), {}),
    "yarn": (("factor", "original_max_position_embeddings"),
             {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None,
              "mscale_all_dim": None, "truncate": True}),
}
_LLAMA3_KEYS = frozenset(_PARAMS["llama3"][0])


class RopeScalingError(ValueError):
    """An invalid RoPE scaling: unknown type, missing, unknown or out-of-range parameter."""


def _name(param: str) -> str:
    flag = PARAM_FLAGS.get(param)
    return f"{param!r} ({flag})" if flag else repr(param)


def normalize_rope_scaling(scaling: Optional[dict]) -> Optional[dict]:
    """The checked, canonical form of ``scaling`` (a new dict with ``rope_type`` and every
    parameter of that type), or None for plain RoPE. Raises :class:`RopeScalingError`.

    A dict without ``rope_type`` holding exactly the Llama-3 parameters is Llama-3 scaling (the
    form the ``llama-3.x`` presets use).
    """
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None)
    if kind is None:
        if set(scaling) == _LLAMA3_KEYS:
            kind = "llama3"
        else:
            raise RopeScalingError(f"RoPE scaling {scaling} has no 'rope_type'; give one of "
                                   f"{', '.join(ROPE_TYPES)}")
    if kind not in ROPE_TYPES:
        raise RopeScalingError(f"unknown RoPE scaling type {kind!r} (--rope-scaling): choose one of "
                               f"{', '.join(ROPE_TYPES)}")
    if kind == "none":
        extra = [k for k, v in scaling.items() if v is not None]
        if extra:
            raise RopeScalingError(f"RoPE scaling 'none' takes no parameters, got "
                                   f"{', '.join(_name(k) for k in extra)}")
        return None
    required, optional = _PARAMS[kind]
    unknown = [k for k in scaling if k not in required and k not in optional]
    if unknown:
        raise RopeScalingError(f"RoPE scaling {kind!r} does not take "
                               f"{', '.join(_name(k) for k in unknown)}; its parameters are "
                               f"{', '.join(list(required) + list(optional))}")
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise RopeScalingError(f"RoPE scaling {kind!r} needs {', '.join(_name(k) for k in missing)}")
    out: dict = {"rope_type": kind}
    for k in required:
        out[k] = scaling[k]
    for k, default in optional.items():
        v = scaling.get(k)
        out[k] = default if v is None else v

    def number(k, positive=True):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RopeScalingError(f"RoPE scaling {kind!r}: {_name(k)} must be a number, got {v!r}")
        if positive and v <= 0:
            raise RopeScalingError(f"RoPE scaling {kind!r}: {_name(k)} must be positive, got {v}")
        return float(v)

    out["factor"] = number("factor")
    if out["factor"] < 1:
        raise RopeScalingError(f"RoPE scaling {kind!r}: {_name('factor')} must be >= 1 (it is the "
                               f"context extension ratio), got {out['factor']}")
    if "original_max_position_embeddings" in out:
        v = out["original_max_position_embeddings"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v <= 0:
            raise RopeScalingError(f"RoPE scaling {kind!r}: {_name('original_max_position_embeddings')} "
                                   f"must be a positive integer, got {v!r}")
        out["original_max_position_embeddings"] = int(v)
    if kind == "llama3":
        lo, hi = number("low_freq_factor"), number("high_freq_factor")
        if hi <= lo:
            raise RopeScalingError(f"RoPE scaling 'llama3': {_name('high_freq_factor')} {hi} must be "
                                   f"larger than {_name('low_freq_factor')} {lo}")
        out["low_freq_factor"], out["high_freq_factor"] = lo, hi
    if kind == "yarn":
        fast, slow = number("beta_fast"), number("beta_slow")
        if fast <= slow:
            raise RopeScalingError(f"RoPE scaling 'yarn': {_name('beta_fast')} {fast} must be larger "
                                   f"than {_name('beta_slow')} {slow}")
        out["beta_fast"], out["beta_slow"] = fast, slow
        for k in ("attention_factor", "mscale", "mscale_all_dim"):
            if out[k] is not None:
                out[k] = number(k)
        if not isinstance(out["truncate"], bool):
            raise RopeScalingError(f"RoPE scaling 'yarn': 'truncate' must be true or false, got "
                                   f"{out['truncate']!r}")
    return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """The factor cos/sin are multiplied by: YaRN's attention factor, 1 for every other type."""
    sc = normalize_rope_scaling(scaling)
    if sc is None or sc["rope_type"] != "yarn":
        return 1.0
    if sc["attention_factor"] is not None:
        return sc["attention_factor"]
    if sc["mscale"] and sc["mscale_all_dim"]:  # DeepSeek's form
        return _yarn_mscale(sc["factor"], sc["mscale"]) / _yarn_mscale(sc["factor"], sc["mscale_all_dim"])
    return _yarn_mscale(sc["factor"])


def _plain(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return 1.0 / (base ** exponents)


def rope_inv_freq(head_dim: int, base: float, scaling: Optional[dict] = None,
                  seq_len: Optional[int] = None) -> torch.Tensor:
    """float32 inverse frequencies ``[head_dim / 2]`` for RoPE with ``scaling``.

    ``seq_len`` matters only for ``dynamic-ntk``: the sequence length the frequencies are for
    (None or at most ``original_max_position_embeddings``: plain RoPE).
    """
    if head_dim <= 0 or head_dim % 2:
        raise RopeScalingError(f"rotary embeddings need a positive even head dimension, got {head_dim}")
    if base <= 1:
        raise RopeScalingError(f"RoPE base (--rotary-base / rope_theta) must be > 1, got {base}")
    sc = normalize_rope_scaling(scaling)
    inv = _plain(head_dim, base)
    kind = sc["rope_type"] if sc else "none"
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "dynamic-ntk":
        old = sc["original_max_position_embeddings"]
        if seq_len is not None and seq_len > old:
            grown = base * (sc["factor"] * seq_len / old - (sc["factor"] - 1)) ** (head_dim / (head_dim - 2))
            inv = _plain(head_dim, grown)
    elif kind == "llama3":
        factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "yarn":
        factor, old = sc["factor"], sc["original_max_position_embeddings"]

        def dim_of(rotations: float) -> float:
            # the (fractional) pair index i whose frequency turns `rotations` times over `old` tokens:
            # old * base ** (-2 i / d) = 2 pi rotations
            return head_dim * math.log(old / (2 * math.pi * rotations)) / (2 * math.log(base))

        lo, hi = dim_of(sc["beta_fast"]), dim_of(sc["beta_slow"])
        if sc["truncate"]:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if hi == lo:
            hi += 1e-3
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        # ramp 0: keep the frequency (fast dimensions), 1: interpolate (divide by factor)
        inv = inv / factor * ramp + inv * (1 - ramp)
    return inv.float()


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[b, 1, s, d/2]`` for ``position_ids [b, s]`` (times ``attention_factor``)."""
    angles = position_ids.unsqueeze(-1).float() * inv_freq  # [b, s, d/2]
    angles = angles.unsqueeze(1)  # [b, 1, s, d/2]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def rope_context_length(scaling: Optional[dict]) -> Optional[int]:
    """The context a scaling extends to (``factor x original``), None without scaling or when the
    type has no original length."""
    sc = normalize_rope_scaling(scaling)
    if sc is None or "original_max_position_embeddings" not in sc:
        return None
    return int(sc["factor"] * sc["original_max_position_embeddings"])


__all__ = ["ROPE_TYPES", "RopeScalingError", "normalize_rope_scaling", "rope_inv_freq",
           "rope_attention_factor", "rope_cos_sin", "rope_context_length"]
