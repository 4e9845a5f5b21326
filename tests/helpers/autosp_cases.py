"""Parity cases for the AutoSP tests: each builds a model and a batch, runs it on one device and
through ``autosp_compile`` on every rank, and compares loss and summed gradients.

Kept in one importable module so one process launch runs many cases (spawning and compiling are
the expensive parts on CPU).
"""
from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

VOCAB = 256


def _batch(seq, batch=2, vocab=VOCAB, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, ids.clone()


def _loss(out):
    from autosp_lm.strategies import extract_loss
    return extract_loss(out)


def _logits(out):
    if isinstance(out, dict):
        return out.get("logits")
    return getattr(out, "logits", None)


@dataclass(frozen=True)
class Case:
    """One AutoSP parity case: a model (ours or an independently written decoder), a batch
    variant and the compile options."""

    model: str  # gpt-tiny | llama-tiny | llama-style | llama-style-kv1 | gpt2-style | hf-style |
    #            flip | zloss | mixing | einsum | moe | scan | chunked-moe (tests/helpers/decoders/)
    layers: int = 2
    seq: int = 16
    positions: bool = False  # pass position_ids (offset by 5) instead of building them inside
    ignore: str = ""  # "" | "some" (scattered ignored targets) | "first-half" (rank 0 of 2: none)
    sac: bool = False
    dict_output: bool = False  # hf-style: return a dict with the logits
    repeat_kv: bool = False  # hf-style: 2 kv heads repeated in the graph (HF's repeat_kv)
    backend: str = "aot_eager"
    ulysses_degree: int = 0  # 0: AutoSP chooses; else U of the U x R plan
    heads: int = 0  # llama-style: number of (query = kv) heads (0: the decoder's default)
    documents: bool = False  # our models: a packed batch with document_ids
    opts: tuple = ()  # decoder options (name, value) for mixing | einsum | moe | scan
    bf16: bool = False  # both runs under torch.autocast(bfloat16); also an fp32 reference
    compile_opts: tuple = ()  # more autosp_compile options (name, value): max_context, ...

    @property
    def id(self) -> str:
        parts = [self.model, f"{self.layers}l", f"s{self.seq}"]
        parts += [name for name, on in (("positions", self.positions), ("sac", self.sac),
                                         ("dict", self.dict_output), ("repeatkv", self.repeat_kv))
                  if on]
        parts += [f"ignore-{self.ignore}"] if self.ignore else []
        parts += [f"U{self.ulysses_degree}"] if self.ulysses_degree else []
        parts += [f"h{self.heads}"] if self.heads else []
        parts += ["docs"] if self.documents else []
        parts += ["bf16"] if self.bf16 else []
        parts += [f"{k}={v}" for k, v in self.opts + self.compile_opts]
        return ":".join(parts + ([self.backend] if self.backend != "aot_eager" else []))


DECODERS = {"mixing": ("mixing_style", "MixingLM"), "einsum": ("einsum_style", "EinsumLM"),
            "moe": ("moe_style", "MoELM"), "scan": ("scan_style", "ScanLM"),
            "hooks": ("hooks_style", "HookLM"),
            "chunked-moe": ("chunked_moe_style", "ChunkedMoELM")}


def build_case(case: Case):
    """-> (model, kwargs) for one case."""
    torch.manual_seed(0)
    from autosp_lm.models import build_model, preset_config
    from tests.helpers.decoders.gpt2_style import GPT2StyleLM
    from tests.helpers.decoders.hf_style import HFStyleLM
    from tests.helpers.decoders.llama_style import LlamaStyleLM
    seq, base, layers = case.seq, case.model, case.layers
    ids, labels = _batch(seq, vocab=512 if base in ("gpt-tiny", "llama-tiny") else VOCAB)
    if base in ("gpt-tiny", "llama-tiny"):
        model = build_model(preset_config(base, num_layers=layers))
    elif base == "llama-style":
        model = (LlamaStyleLM(vocab=VOCAB, n_layers=layers, dim=8 * case.heads,
                              n_heads=case.heads, n_kv_heads=case.heads) if case.heads
                 else LlamaStyleLM(vocab=VOCAB, n_layers=layers))
    elif base == "llama-style-kv1":
        model = LlamaStyleLM(vocab=VOCAB, n_kv_heads=1, n_layers=layers)
    elif base == "gpt2-style":
        model = GPT2StyleLM(vocab=VOCAB, n_layer=layers)
    elif base == "hf-style":
        model = HFStyleLM(vocab=VOCAB, layers=layers, return_dict=case.dict_output,
                          kv_heads=2 if case.repeat_kv else 1, use_repeat_kv=case.repeat_kv)
    elif base in DECODERS:
        module, cls = DECODERS[base]
        mod = __import__(f"tests.helpers.decoders.{module}", fromlist=[cls])
        model = getattr(mod, cls)(vocab=VOCAB, layers=layers, **dict(case.opts))
    elif base == "flip":
        model = FlipLM()
    elif base == "cut":
        model = CutLM()
    elif base == "zloss":
        model = ZLossLM()
    else:
        raise KeyError(base)
    kwargs = {"input_ids": ids}
    if base != "gpt2-style":
        kwargs["labels"] = labels
    if case.ignore == "first-half":  # rank 0 of 2 has no valid target at all
        labels[:, : seq // 2 + 1] = -100
    elif case.ignore == "some":
        labels[0, 1::3] = -100
        labels[1, seq - 3:] = -100
    if case.positions:
        kwargs["position_ids"] = (torch.arange(seq) + 5).unsqueeze(0).expand(2, seq).contiguous()
    if case.documents:  # documents straddling shard boundaries and spanning several shards
        doc = torch.zeros(2, seq, dtype=torch.long)
        for b, cuts in enumerate([(3, seq // 2 + 1), (seq // 4, seq // 4 + 3)]):
            for c in cuts:
                doc[b, c:] += 1
        kwargs["document_ids"] = doc
    return model, kwargs


class FlipLM(torch.nn.Module):
    """A decoder with an op that mixes sequence positions AutoSP has no rule for (a flip of the
    sequence): must fall back to gather/compute/re-shard with exact results."""

    def __init__(self, vocab=VOCAB, dim=32, heads=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)
        self.heads = heads

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        x = x + 0.1 * x.flip(1)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(b, s, d)
        return torch.nn.functional.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


class CutLM(FlipLM):
    """Slices of the sequence that are neither shifts nor of constant length: a summary of the
    first half of the sequence and a strided sub-sample (fall back, named with cause and fix)."""

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        b, s, d = x.shape
        x = x + x[:, : s // 2].mean(1, keepdim=True) + x[:, ::4].mean(1, keepdim=True)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(b, s, d)
        return torch.nn.functional.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


class ZLossLM(FlipLM):
    """Loss terms beyond cross entropy: a z-loss (mean over all tokens of a per-token value) and
    an L2 penalty on a parameter (a replicated term added to the per-rank loss)."""

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.out(x + y.transpose(1, 2).reshape(b, s, d))
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                               reduction="sum") / labels.numel()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return ce + 1e-2 * z + 1e-3 * self.out.weight.pow(2).sum()


def run_case(rank, world, case: Case):
    from autosp_lm.compiler import autosp_compile
    from autosp_lm.training.memory import SavedTensorBytes
    torch._dynamo.reset()
    model, kwargs = build_case(case)
    # a model that changes itself on its first call gets its reference from an untouched copy
    ref_model = copy.deepcopy(model) if case.model == "hooks" else model

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.bf16)

    def reference(enabled):
        ref_model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = ref_model(**kwargs)
        loss = _loss(out)
        loss.backward()
        return out, loss, {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()
                           if p.grad is not None}

    ref_out, ref, ref_grads = reference(case.bf16)
    ref_logits = _logits(ref_out)
    _, fp32_ref, fp32_grads = reference(False) if case.bf16 else (None, None, None)
    model.zero_grad()
    run = autosp_compile(model, backend=case.backend, sac=case.sac, verbose=False,
                         ulysses_degree=case.ulysses_degree or None, **dict(case.compile_opts))
    with SavedTensorBytes(exclude=model) as saved, autocast():
        out = run(**kwargs)
    loss = _loss(out)
    loss.backward()
    local_tokens = kwargs["input_ids"].numel() // world
    result = {"ref": ref.item(), "loss": loss.item(), "grad_err": {},
              "report": run.report.as_dict(), "text": run.report.text(),
              "saved_per_token": saved.bytes / local_tokens,
              "sac_stats": [{k: v for k, v in st.items() if k != "saved"}
                            for st in getattr(run, "sac_stats", None) or []]}
    if case.bf16:  # and how far the one-device bf16 run itself is from fp32
        result.update(fp32_ref=fp32_ref.item(), grad_err_fp32={}, ref_err_fp32={
            n: (g - fp32_grads[n]).norm().item() / max(fp32_grads[n].norm().item(), 1e-30)
            for n, g in ref_grads.items()})
    for n, p in model.named_parameters():
        if n not in ref_grads:
            continue
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        for key, want in (("grad_err", ref_grads), ("grad_err_fp32", fp32_grads)):
            if want is not None:
                denom = want[n].norm().item()
                result[key][n] = (g - want[n]).norm().item() / max(denom, 1e-30)
    logits = _logits(out)
    if ref_logits is not None and logits is not None:
        want = ref_logits[:, run.local_positions(case.seq)]  # this rank's positions (the plan's)
        result["logits_err"] = ((logits.float() - want.float()).norm() / want.float().norm()).item()
    return result


def check_parity(results, case, tol=1e-5):
    """The parity contract of one case over the ranks' results: no rank failed, every rank
    reports the same loss, within ``tol`` (relative) of the single-device loss, every summed
    gradient within ``tol`` (and there are gradients), the logits of the rank's positions within
    ``tol`` where recorded. A bf16 case is held to the bf16 bounds instead
    (:func:`check_bf16_parity`): ``tol`` is an fp32 bound. Returns rank 0's result."""
    if case.bf16:
        return check_bf16_parity(results, case)
    ranks = [r[case] for r in results]
    for rank, res in enumerate(ranks):
        assert "error" not in res, f"rank {rank} failed:\n{res['error']}"
    ref = ranks[0]["ref"]
    for rank, res in enumerate(ranks):
        assert res["loss"] == ranks[0]["loss"], f"rank {rank} reports a different loss"
        assert abs(res["loss"] - ref) <= tol * abs(ref), (res["loss"], ref)
        bad = {n: e for n, e in res["grad_err"].items() if e > tol}
        assert not bad, f"rank {rank}: gradients differ: {bad}"
        assert len(res["grad_err"]) > 0
        if "logits_err" in res:
            assert res["logits_err"] <= tol, res["logits_err"]
    return ranks[0]


def check_bf16_parity(results, case):
    """bf16 autocast against one device with the tolerances of tests/training/test_bf16.py:
    every gradient within 8u of fp32 and 4u of the one-device bf16 run, the loss within 2e-4
    and 1e-4 (relative); the same loss on every rank. The 4u bound rests on each bf16 run being
    about 2u from the exact gradient; where the one-device bf16 run is itself further from fp32
    (e_ref: a bf16 cumprod rounds at every position), the bound is 2u + e_ref, and both loss
    bounds grow by the one-device run's own relative loss error the same way: against the
    one-device bf16 run ``1e-4/2 + e_ref`` and against fp32 ``2e-4/2 + e_ref`` (this run's own
    rounding plus the reference's; a decoder with an unnormalised loss of ~42 has e_ref = 3.1e-4,
    over the flat 2e-4 that any bf16 run of it, one-device included, would miss). Returns rank
    0's result."""
    from tests.training.test_bf16 import (GRAD_TOL_BF16, GRAD_TOL_FP32, LOSS_TOL_BF16,
                                          LOSS_TOL_FP32)
    assert case.bf16, f"{case.id} is not a bf16 case: use check_parity"
    ranks = [r[case] for r in results]
    for rank, res in enumerate(ranks):
        assert "error" not in res, f"rank {rank} failed:\n{res['error']}"
    u = GRAD_TOL_BF16 / 4
    for rank, res in enumerate(ranks):
        assert res["loss"] == ranks[0]["loss"], f"rank {rank} reports a different loss"
        fp32, ref = res["fp32_ref"], res["ref"]
        e_ref = abs(ref - fp32) / abs(fp32)
        fp32_tol = max(LOSS_TOL_FP32, LOSS_TOL_FP32 / 2 + e_ref)
        assert abs(res["loss"] - fp32) <= fp32_tol * abs(fp32), (res["loss"], fp32, fp32_tol)
        ref_tol = max(LOSS_TOL_BF16, LOSS_TOL_BF16 / 2 + e_ref)
        assert abs(res["loss"] - ref) <= ref_tol * abs(ref), (res["loss"], ref, ref_tol)
        bad = {n: e for n, e in res["grad_err_fp32"].items() if e > GRAD_TOL_FP32}
        assert not bad, f"rank {rank}: gradients over {GRAD_TOL_FP32} from fp32: {bad}"
        bad = {n: (e, res["ref_err_fp32"][n]) for n, e in res["grad_err"].items()
               if e > max(GRAD_TOL_BF16, 2 * u + res["ref_err_fp32"][n])}
        assert not bad, f"rank {rank}: gradients far from the one-device bf16 run: {bad}"
        assert res["grad_err"]
    return ranks[0]


def worker(rank, world, cases):
    results = {}
    for case in cases:
        try:
            results[case] = run_case(rank, world, case)
        except Exception:  # noqa: BLE001 - reported per case
            results[case] = {"error": traceback.format_exc()}
    return results


# -- error cases --------------------------------------------------------------------------------
class NoAttentionLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels):
        return torch.nn.functional.cross_entropy(self.out(self.emb(input_ids)).flatten(0, 1),
                                                 labels.flatten())


class GraphBreakLM(NoAttentionLM):
    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        if x.sum().item() > 0:  # data-dependent Python control flow: a graph break
            x = x * 2
        return torch.nn.functional.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


class ExplicitBreakLM(NoAttentionLM):
    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())


def error_worker(rank, world):
    from autosp_lm.compiler import AutoSPError, autosp_compile
    from tests.helpers.decoders.llama_style import LlamaStyleLM
    out = {}

    def attempt(key, model, seq, **opts):
        torch._dynamo.reset()
        ids, labels = _batch(seq)
        run = autosp_compile(model, backend="aot_eager", sac=False, verbose=False, **opts)
        try:
            run(input_ids=ids, labels=labels)
            out[key] = "no error"
        except AutoSPError as e:
            out[key] = "AutoSPError: " + str(e)
        except Exception as e:  # noqa: BLE001
            out[key] = f"{type(e).__name__}: {e}"

    attempt("indivisible", LlamaStyleLM(vocab=VOCAB, n_layers=1), 15)
    # 3 heads at P = 2 plan a ring (1 x 2), whose zigzag layout needs a multiple of 2P tokens
    attempt("heads", LlamaStyleLM(vocab=VOCAB, dim=48, n_heads=3, n_kv_heads=3, n_layers=1), 18)
    attempt("no_attention", NoAttentionLM(), 16)
    attempt("graph_break", GraphBreakLM(), 16)
    attempt("graph_break_explicit", ExplicitBreakLM(), 16)
    # 4 query heads, 2 per rank: 3 groups cannot split them
    attempt("head_groups", LlamaStyleLM(vocab=VOCAB, n_layers=1), 16, attention_head_groups=3)
    return out


def strategy_worker(rank, world):
    from autosp_lm.strategies.autosp import AutoSPStrategy
    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel.state import ParallelState
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(preset_config("llama-tiny", num_layers=1))
    ids, labels = _batch(32, vocab=512)
    batch = {"input_ids": ids, "labels": labels,
             "position_ids": torch.arange(32).unsqueeze(0).expand(2, 32).contiguous()}
    ref = model(ids, position_ids=batch["position_ids"], labels=labels).item()
    ps = ParallelState(rank=rank, world_size=world, sp_size=world, sp_rank=rank,
                       sp_group=dist.group.WORLD)
    strat = AutoSPStrategy(ps, sac=False, backend="aot_eager", verbose=False)
    assert strat.options.sac is False
    strat.setup(model)
    loss, reported = strat.forward_loss(batch)
    loss.backward()
    return {"ref": ref, "reported": reported.item(), "report": strat.report(),
            "requires_grad": loss.requires_grad}


# -- a step of any (input_ids, labels) -> loss model against one device ------------------------
def against_one_device(model, ids, runners=None):
    """One step of ``model`` (``input_ids``/``labels`` -> loss) on one device and through AutoSP
    (aot_eager) on this rank's group: (loss, one-device loss, largest relative error of the
    SP-summed gradients, the report as a dict), or the text of the error AutoSP raised. The
    compiled runner is appended to ``runners`` when given."""
    from autosp_lm.compiler import autosp_compile
    torch._dynamo.reset()
    labels = torch.roll(ids, -1, 1)
    ref = model(ids, labels)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    run = autosp_compile(model, backend="aot_eager", verbose=False)
    if runners is not None:
        runners.append(run)
    try:
        loss = run(input_ids=ids, labels=labels)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return f"{type(e).__name__}: {e}"
    loss.backward()
    err = 0.0
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        err = max(err, ((g - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item())
    return loss.item(), ref.item(), err, run.report.as_dict()


def chunked_ssd_inductor_worker(rank, world, which="ssd"):
    """ChunkedSSD (padded to a multiple of the chunk; ``which="delta"``: the gated delta rule's
    DeltaNet) through AutoSP on Inductor, fp32 and bf16 autocast, against one device: per dtype
    (loss, one-device loss, fp32 one-device loss, {param: relative error of the SP-summed
    gradient against the one-device run}, {param: the same against fp32}, {param: the one-device
    run's own error against fp32}, the forward collectives, the report's fallbacks)."""
    from autosp_lm.compiler import autosp_compile
    from tests.helpers.decoders.delta_style import DeltaNet
    from tests.helpers.decoders.ssd_style import ChunkedSSD
    ids = torch.randint(0, 64, (2, 8 * world), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    def one_device(model, bf16):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids, labels)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    out = {}
    for bf16 in (False, True):
        torch._dynamo.reset()
        model = ChunkedSSD(pad=True) if which == "ssd" else DeltaNet()
        fp32_loss, fp32 = one_device(model, False)
        ref_loss, ref = one_device(model, bf16)
        model.zero_grad()
        run = autosp_compile(model, backend="inductor", verbose=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = run(input_ids=ids, labels=labels)
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[n] = g
        out[bf16] = (loss.item(), ref_loss, fp32_loss,
                     {n: rel(g, ref[n]) for n, g in grads.items()},
                     {n: rel(g, fp32[n]) for n, g in grads.items()},
                     {n: rel(ref[n], fp32[n]) for n in grads},
                     run.report.as_dict()["collectives_forward"], run.report.as_dict()["fallbacks"])
    return out
