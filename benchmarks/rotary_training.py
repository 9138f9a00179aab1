"""Why `optimize` keeps HF's rotary in training (issue 26): with RoPE fused into the attention forward
(`hf_attention.rotary_attention_forward`) for training too, the GPU test `test_llama_training_gradients_kept`
failed on 2026-12-04 and was never diagnosed (commit 07daca6 limited the fused RoPE to inference). On the
CPU (interpreter, fp16 and fp32) the gradients pass. This check runs the GPU test's model (Llama, hidden
1024, head dim 128, GQA 8/2) in bf16 and fp16: `optimize(training=True)` (attention without RoPE, as
shipped), then each attention's forward bound to the rotary one by hand, and every parameter's gradient
of one loss compared with a float64 copy's under the DESIGN.md section 3 criterion (the unfused bf16 model's
error sets the tolerance). It prints the worst gradients and any exception.

    python benchmarks/rotary_training.py [--dtype bfloat16,float16] [--seq 256] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import traceback
import types

import torch


def _llama(dtype: torch.dtype, device: str, small: bool):
    import transformers

    torch.manual_seed(0)
    size = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2) if small else {}
    cfg = dict(
        vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, attn_implementation="sdpa",
    ) | size  # fmt: skip
    with torch.device(device):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(dtype)


def check(dtype: torch.dtype, device: str, seq: int, small: bool) -> None:
    import fuseformer
    from fuseformer.fusion import hf_attention
    from fuseformer.testing import max_err, tolerance

    model = _llama(dtype, device, small).train()
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model)
    report = fuseformer.optimize(model, training=True, include=["attention"])
    bound = 0
    for module in model.modules():
        state = hf_attention.rotary_state(module)
        if state is not None:
            module.__dict__["_fuseformer_rotary"] = state
            module.forward = types.MethodType(hf_attention.rotary_attention_forward, module)
            bound += 1
    print(f"# {dtype}: {report.counts()} replaced, rotary bound on {bound} attention modules")
    ids = torch.randint(0, model.config.vocab_size, (2, seq), device=device)
    try:
        for m in (model, ref, base):
            m(input_ids=ids, labels=ids).loss.backward()
    except Exception:
        traceback.print_exc()
        return
    rows = []
    for (name, p), p_ref, p_base in zip(model.named_parameters(), ref.parameters(), base.parameters()):
        if p.grad is None:
            rows.append((float("inf"), name, "no grad"))
            continue
        err, tol = max_err(p.grad, p_ref.grad), tolerance(p_ref.grad, p_base.grad, dtype)
        rows.append((err / tol, name, f"err {err:.3g} tol {tol:.3g} base {max_err(p_base.grad, p_ref.grad):.3g}"))
    rows.sort(reverse=True)
    print(f"# {dtype}: {sum(r[0] > 1 for r in rows)} of {len(rows)} gradients over tolerance; worst:")
    for ratio, name, text in rows[:8]:
        print(f"  {ratio:7.2f}x  {name:<48} {text}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16,float16")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="hidden 128 (CPU interpreter runs)")
    args = p.parse_args()
    for name in args.dtype.split(","):
        check(getattr(torch, name), args.device, args.seq, args.small)


if __name__ == "__main__":
    main()
