"""The longest trainable sequence within a memory budget: on CPU a fit of the measured peaks
against the sequence length, on CUDA a search (double, then bisect; each trial a fresh job)."""
from __future__ import annotations

from . import launch


def fit_max_context(points: list[tuple[int, float]], budget_bytes: float):
    """Fit peak = a + b*S by least squares (memory is linear in S: flash attention keeps no
    S x S matrix) and solve a + b*S = budget. Returns (max_seq, [b, a]), or (None, coefficients)
    when there are fewer than two points or the fit does not grow with S."""
    import numpy as np
    pts = [(s, m) for s, m in points if m is not None and m > 0]
    if len(pts) < 2 or len({s for s, _ in pts}) < 2:
        return None, None
    s = np.array([p[0] for p in pts], dtype=float)
    m = np.array([p[1] for p in pts], dtype=float)
    slope, intercept = np.polyfit(s, m, 1)
    # a flat series fits a slope of rounding noise (~1e-12, either sign): growth over the
    # measured range below a millionth of the peak is no growth
    if slope * (s.max() - s.min()) <= 1e-6 * float(np.abs(m).max()):
        return None, [float(slope), float(intercept)]
    return int((budget_bytes - intercept) / slope), [float(slope), float(intercept)]


def fit_peak(r: dict):
    """The peak a CPU fit uses for one cell: the exact live-tensor peak of a step
    (``peak_live_bytes``, deterministic) where the cell has it, else the resident-set peak (coarse:
    malloc keeps freed memory, so it can stay flat or shrink between two lengths)."""
    live = r.get("peak_live_bytes")
    return live if live is not None else r.get("peak_mem_bytes")


def fit_all(results: list[dict], strategies: list[str], budget_bytes: float) -> dict:
    """CPU: per strategy, the fitted longest sequence within the budget, or None with the reason
    (fitted to :func:`fit_peak`: the exact live-tensor peak of a step, i.e. the step's
    activations, transients and gradients above the weights and optimizer state)."""
    out = {}
    for s in strategies:
        pts = [(r["seq_length"], fit_peak(r)) for r in results
               if r["strategy"] == s and r.get("status") == "ok"]
        best, coef = fit_max_context(pts, budget_bytes)
        lengths = {L for L, m in pts if m}
        reason = None
        if best is None:
            reason = ("no successful cell" if not pts else
                      f"a fit needs two or more sequence lengths, got {len(lengths)}" if len(lengths) < 2
                      else "peak memory did not grow with the sequence length")
        elif best <= 0:
            best, reason = None, "the measured peaks already exceed the budget"
        out[s] = {"max_seq_length": best, "method": "fit", "coefficients": coef, "points": pts,
                  "reason": reason}
    return out


def longest_fit(fits, lo: int, seq: int, limit: int, granularity: int, more=lambda: True):
    """Double ``seq`` while ``fits(seq)`` and ``seq <= limit``, then bisect between the longest
    length that fit and the first that did not, to a multiple of ``granularity``; ``more()``
    false (a deadline) ends either loop. ``lo``: the longest length known to fit so far.
    Returns ``(lo, hi, seq)``: the longest length that fit, the shortest that did not (None
    when the doubling found none) and the next length the doubling would have tried."""
    hi = None
    while more() and seq <= limit:
        if not fits(seq):
            hi = seq
            break
        lo, seq = seq, seq * 2
    while hi is not None and hi - lo > granularity and more():
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi, seq


def search_max_context(cell: dict, budget_gb: float, start: int, timeout: float, granularity: int,
                       limit: int = 1 << 24) -> dict:
    """CUDA: double the sequence until a trial exceeds the budget or OOMs, then bisect."""
    budget = budget_gb * 2**30
    trials = []

    def fits(seq):
        r = launch.launch_cell(dict(cell, seq_length=seq, steps=1), timeout)
        trials.append({"seq_length": seq, "status": r.get("status"),
                       "peak_mem_bytes": r.get("peak_mem_bytes")})
        return (r.get("status") == "ok" and r.get("peak_mem_bytes") is not None
                and r["peak_mem_bytes"] <= budget)

    lo, _, _ = longest_fit(fits, 0, start, limit, granularity)
    return {"max_seq_length": lo or None, "method": "search", "trials": trials}
