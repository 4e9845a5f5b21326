"""The parity checks themselves (tests/helpers/autosp_cases.py), on results written by hand: a
check that lets a wrong result through, or refuses a right one, makes every parity test that uses
it meaningless. No launch: these run in milliseconds."""
from __future__ import annotations

import pytest

from tests.helpers import autosp_cases as C

CASE = C.Case("gpt2-style", layers=1, seq=32, ulysses_degree=2, sac=True, bf16=True,
              backend="inductor")


def _rank(loss, ref, fp32_ref, grad_err=0.004, ref_err=0.004, fp32_err=0.006):
    return {CASE: {"loss": loss, "ref": ref, "fp32_ref": fp32_ref,
                   "grad_err": {"w": grad_err}, "ref_err_fp32": {"w": ref_err},
                   "grad_err_fp32": {"w": fp32_err}}}


def test_bf16_loss_bound_grows_with_the_reference_error():
    # the measured gpt2-style 2x2 + SAC case (4 ranks, bf16, Inductor): an unnormalised loss of
    # ~42; the one-device bf16 run is 3.1e-4 (relative) from fp32, this run 2.6e-4 from fp32 and
    # 0.5e-4 from the one-device bf16 run. A flat 2e-4 bound against fp32 refuses it, and would
    # refuse the one-device bf16 run itself.
    fp32 = 42.0
    ref = fp32 * (1 + 3.1e-4)
    loss = fp32 * (1 + 2.6e-4)
    C.check_bf16_parity([_rank(loss, ref, fp32)] * 4, CASE)
    C.check_bf16_parity([_rank(ref, ref, fp32)] * 4, CASE)  # exactly the one-device bf16 loss


@pytest.mark.parametrize("loss_rel", [
    1.5e-3,    # far from both references
    -3.0e-4,   # 6.1e-4 from the one-device bf16 run (which is at +3.1e-4): over 1e-4/2 + e_ref
])
def test_bf16_loss_bound_still_refuses_wrong_losses(loss_rel):
    fp32 = 42.0
    ref = fp32 * (1 + 3.1e-4)
    with pytest.raises(AssertionError):
        C.check_bf16_parity([_rank(fp32 * (1 + loss_rel), ref, fp32)] * 4, CASE)


def test_bf16_loss_bound_is_flat_when_the_reference_is_close():
    # e_ref = 1e-6: the flat bounds (2e-4 from fp32, 1e-4 from the bf16 run) hold
    fp32 = 6.25
    ref = fp32 * (1 + 1e-6)
    C.check_bf16_parity([_rank(fp32 * (1 + 0.9e-4), ref, fp32)] * 2, CASE)
    with pytest.raises(AssertionError):
        C.check_bf16_parity([_rank(fp32 * (1 + 2.5e-4), ref, fp32)] * 2, CASE)


def test_bf16_gradient_and_rank_checks():
    fp32 = 6.25
    with pytest.raises(AssertionError, match="far from the one-device"):
        C.check_bf16_parity([_rank(fp32, fp32, fp32, grad_err=0.02)] * 2, CASE)
    with pytest.raises(AssertionError, match="from fp32"):
        C.check_bf16_parity([_rank(fp32, fp32, fp32, fp32_err=0.05)] * 2, CASE)
    with pytest.raises(AssertionError, match="different loss"):
        C.check_bf16_parity([_rank(fp32, fp32, fp32), _rank(fp32 * (1 + 1e-7), fp32, fp32)],
                            CASE)
