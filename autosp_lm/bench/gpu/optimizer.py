"""The ``optimizer`` section: one AdamW step through the apex ``FusedAdam`` path when apex is
built and the torch fused path otherwise (both when possible), against a float64 reference."""
from __future__ import annotations

import torch

from .common import Row, rel


def section_optimizer(args, deadline) -> list:
    from autosp_lm.training.optimizer import apex_fused_adam, build_optimizer
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows = []
    torch.manual_seed(0)

    def one_step(opt_factory):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).to(device)
        torch.manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt = opt_factory(model)
        opt.step()
        return [p.detach().double().cpu() for p in model.parameters()]

    def reference(model):  # build_optimizer's hyper-parameters, the plain for-loop AdamW
        return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=0.0, foreach=False)

    torch.manual_seed(0)
    ref = one_step(reference)
    apex = apex_fused_adam()
    torch.manual_seed(0)
    got = one_step(lambda m: build_optimizer(m, lr=1e-2, weight_decay=0.0, device=device))
    err = max(rel(a, b) for a, b in zip(got, ref))
    path = ("apex FusedAdam" if apex is not None and device.type == "cuda"
            else "torch fused AdamW" if device.type == "cuda" else "torch AdamW")
    rows.append(Row("optimizer", f"build_optimizer ({path})", "ok" if err < 1e-5 else "FAIL",
                    "apex " + ("present" if apex is not None else "absent"), max_err=err))
    if apex is not None and device.type == "cuda":  # the absent path too
        torch.manual_seed(0)
        got = one_step(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                                   eps=1e-8, weight_decay=0.0, fused=True))
        err = max(rel(a, b) for a, b in zip(got, ref))
        rows.append(Row("optimizer", "torch fused AdamW (apex absent path)",
                        "ok" if err < 1e-5 else "FAIL", max_err=err))
    return rows

