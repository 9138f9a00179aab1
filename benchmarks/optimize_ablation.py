"""Which of optimize's replacements pays, one kind at a time (issue 26's investigation, run 112).

For the BERT-base encoder (B 32 x S 512) and the Llama-3-8B prefill (B 1 x S 4096), random bf16 weights:
HF eager, then ``fuseformer.optimize(include=[kind])`` for each kind alone (reverted between), then
all kinds; plus the top CUDA kernels of eager and of all-kinds (torch.profiler), so the slower
pieces are named. Writes ``optimize_ablation.json`` under ``--out``.

The ``train`` case is the training goal's (0.904x HF + Liger, run 110): Llama-1B shape, B 4 x S 4096,
gradient checkpointing, one forward + backward per step, ms and peak memory for HF eager, each kind
alone, all kinds (attention with the fused RoPE, the default since run 141), all but attention (SDPA's,
as HF's and Liger's), all kinds with q/k/v and gate/up each as one GEMM over concatenated weights (bound
here by hand: the engine's models pack them; a candidate for optimize's training), and HF + Liger last
(its patch is process-wide); each with its loss, all kernels, and the host time of a step.

    python3 benchmarks/optimize_ablation.py --out results/ [--cases bert,llama,train]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fuseformer
from fuseformer.bench._timing import bench_ms
from fuseformer.bench.optimize import BERT_BASE, LLAMA_8B, _build, _free, _record


def _top_kernels(fn, n: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append(dict(name=e.key[:120], ms_per_call_total=t / 3 / 1e3, count=e.count // 3))
    rows.sort(key=lambda r: -r["ms_per_call_total"])
    total = dict(name="(all kernels)", ms_per_call_total=sum(r["ms_per_call_total"] for r in rows),
                 count=sum(r["count"] for r in rows))  # fmt: skip
    return [total] + rows[:n]


def _host(fn) -> dict:
    """Host time of one forward issued behind a ~0.5 s GPU sleep (a host sync inside shows as >= 0.5 s),
    and the CUDA sync/copy calls of one forward (torch.profiler's CPU events)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    syncs = {}
    for e in prof.key_averages():
        if (
            "Synchronize" in e.key
            or "Memcpy" in e.key
            or e.key in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")
        ):
            syncs[e.key] = e.count
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return dict(host_ms=min(times), syncs=syncs,
                top_cpu=[(e.key[:80], round(e.self_cpu_time_total / 1e3, 3), e.count) for e in top])  # fmt: skip


def ablate(name: str, model, fwd, kinds) -> dict:
    rec = dict(model=name, ms={})
    with torch.no_grad():
        rec["ms"]["eager"] = bench_ms(fwd, warmup=50, rep=400)
        rec["top_eager"] = _top_kernels(fwd)
        rec["host"] = {"eager": _host(fwd)}
        for kind in kinds:
            report = fuseformer.optimize(model, training=False, include=[kind])
            rec["ms"][kind] = bench_ms(fwd, warmup=50, rep=400)
            rec[f"top_{kind}"] = _top_kernels(fwd)
            rec.setdefault("counts", {})[kind] = report.counts()
            rec["host"][kind] = _host(fwd)
            report.revert()
        report = fuseformer.optimize(model, training=False)
        rec["ms"]["all"] = bench_ms(fwd, warmup=50, rep=400)
        rec["top_all"] = _top_kernels(fwd)
        rec["host"]["all"] = _host(fwd)
        report.revert()
    print(name, {k: round(v, 3) for k, v in rec["ms"].items()}, flush=True)
    for kind, h in rec["host"].items():
        print(f"  host {kind}: {h['host_ms']:.2f} ms, syncs {h['syncs']}", flush=True)
    return rec


def _packed_mlp_forward(self, x):
    """A Llama MLP with gate and up as one GEMM over their concatenated weights (the cat's backward splits
    the gradient back to the two parameters): one dX GEMM and no dX add in the backward."""
    import fuseformer.ops as F

    w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
    return self.down_proj(F.swiglu(torch.nn.functional.linear(x, w)))


def _packed_rotary_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """``rotary_attention_forward`` without a cache, q/k/v as one GEMM over their concatenated weights (the
    engine's models pack them): q, k, v are strided views of its output."""
    from fuseformer.fusion.hf_attention import _rotate, fuseformer_attention

    b, s = hidden_states.shape[:-1]
    d, hq, hkv = self.head_dim, self.config.num_attention_heads, self.config.num_key_value_heads
    w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
    bias = None if self.q_proj.bias is None else torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
    q, k, v = torch.nn.functional.linear(hidden_states, w, bias).split([hq * d, hkv * d, hkv * d], -1)
    cos, sin = position_embeddings
    q, k = _rotate(q.view(b, s, hq, d), cos, sin), _rotate(k.view(b, s, hkv, d), cos, sin)
    v = v.view(b, s, hkv, d)
    out, _ = fuseformer_attention(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask,
                                  scaling=self.scaling)  # fmt: skip
    return self.o_proj(out.reshape(b, s, -1)), None


def _bind(model, cls_name: str, forward) -> list:
    """``forward`` bound on every module of class ``cls_name``; returns (module, the instance forward it
    had or None) to put back."""
    import types

    bound = []
    for module in model.modules():
        if type(module).__name__ == cls_name:
            bound.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(forward, module)
    return bound


def ablate_train(batch: int = 4, seq: int = 4096, only: set[str] | None = None) -> dict:
    from fuseformer.bench.optimize import LLAMA_1B
    from fuseformer.train.bench import hf_fwd_bwd_step

    def timed(name, step) -> dict:  # bench optimize's record (warm-up, median ms, peak memory, error)
        rec = _record("train", name, step, "cuda", 3000)
        if "ms" in rec:
            rec["tok_s"] = batch * seq / rec["ms"] * 1e3
        return rec

    rec = dict(model=f"llama-1b train {batch}x{seq}", runs={}, counts={})
    model = _build("LlamaForCausalLM", LLAMA_1B, "cuda").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (batch, seq), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    # "attention" and "all" include the fused RoPE (optimize's default in training since run 141).
    variants = [("eager", None), ("norm", ["norm"]), ("mlp", ["mlp"]), ("attention", ["attention"]),
                ("loss", ["loss"]), ("all", "all"), ("all-but-attention", ["norm", "mlp", "loss"]),
                ("all+packed", "packed")]  # fmt: skip
    for name, include in [v for v in variants if only is None or v[0] in only]:
        report, packed = None, []
        try:
            if include is not None:
                kinds = None if include in ("all", "packed") else include
                report = fuseformer.optimize(model, training=True, include=kinds)
                rec["counts"][name] = report.counts()
                if include == "packed":
                    packed = _bind(model, "LlamaAttention", _packed_rotary_forward)
                    packed += _bind(model, "LlamaMLP", _packed_mlp_forward)
                    rec["counts"][name]["packed_bound"] = len(packed)
            with torch.no_grad():  # the same loss for every variant, within bf16's noise
                rec.setdefault("loss", {})[name] = float(model(input_ids=ids, labels=ids).loss)
            rec["runs"][name] = timed(name, step)
            if name in ("eager", "all", "all+packed"):
                rec[f"top_{name}"] = _top_kernels(step, n=30)
                rec.setdefault("host", {})[name] = _host(step)
        except Exception as exc:  # one variant's failure must not lose the others
            rec["runs"][name] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
        for module, previous in reversed(packed):  # optimize's own bound forwards back before its revert
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.forward = previous
        if report is not None:
            report.revert()
        _print_run(rec, name)
    model = None  # noqa: F841  (its weights and gradients must not count in Liger's peak)
    _free()
    try:
        liger = hf_fwd_bwd_step(LLAMA_1B, batch, seq, "cuda", True)
        rec["runs"]["hf+liger"] = timed("hf+liger", liger)
        rec["top_hf+liger"] = _top_kernels(liger, n=30)
        rec.setdefault("host", {})["hf+liger"] = _host(liger)
    except Exception as exc:
        rec["runs"]["hf+liger"] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
    _print_run(rec, "hf+liger")
    return rec


def _print_run(rec: dict, name: str) -> None:
    print(name, rec["runs"][name], "loss", rec.get("loss", {}).get(name), flush=True)
    if name in rec.get("host", {}):
        h = rec["host"][name]
        print(f"  host {h['host_ms']:.1f} ms a step, syncs {h['syncs']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results")
    p.add_argument("--cases", default="bert,llama")
    p.add_argument("--train-variants", default=None, help="comma-separated names (default: all; HF + Liger always)")
    args = p.parse_args()
    out = []
    if "bert" in args.cases:
        model = _build("BertModel", BERT_BASE, "cuda").eval()
        ids = torch.randint(0, model.config.vocab_size, (32, 512), device="cuda")
        mask = torch.ones_like(ids)
        out.append(ablate("bert-base 32x512", model,
                          lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state,
                          ("norm", "mlp", "attention")))  # fmt: skip
        del model
        torch.cuda.empty_cache()
    if "llama" in args.cases:
        model = _build("LlamaForCausalLM", LLAMA_8B, "cuda").eval()
        ids = torch.randint(0, LLAMA_8B["vocab_size"], (1, 4096), device="cuda")
        out.append(ablate("llama-8b prefill 1x4096", model, lambda: model(input_ids=ids).logits,
                          ("norm", "mlp", "attention", "loss")))  # fmt: skip
        del model
        torch.cuda.empty_cache()
    if "train" in args.cases:  # last: HF + Liger patches transformers' Llama for the whole process
        only = set(args.train_variants.split(",")) if args.train_variants else None
        out.append(ablate_train(only=only))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "optimize_ablation.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
