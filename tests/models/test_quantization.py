"""FP8 inference, the model side (fuseformer/models/quantization.py and the loader's FP8 path).

FP8 checkpoints are made here from the tiny random checkpoints of conftest.py: their safetensors and
config.json rewritten into the forms vLLM reads (``quant_method`` "fp8" with per-tensor
``weight_scale`` or ``weight_scale_inv``; "compressed-tensors" with per-tensor (1,) or per-channel
(N, 1) scales), KV-cache scales included. Logits are judged by the DESIGN.md §3 criterion, with:

- reference: the transformers model holding the dequantized weights, in fp64, activations exact;
- baseline: the same model in fp32 with each decoder linear's input quantized per token (the down
  projection's per group of 128), as FP8 inference quantizes it, through ``quantize_fp8`` and
  ``dequantize_fp8``: the error FP8 activations make, computed by PyTorch.

So our FP8 logits may be off the dequantized model by at most twice what FP8 activations themselves
cost (plus fp32's floor). That bound is loose (the FP8 error is large: a 5% error in one layer's
scales stays inside it), so the logits must also be within a tenth of that FP8 error of the baseline
itself: both quantize the same values (up to fp32 rounding) to the same e4m3 codes, and only a tie
that rounds the other way (one activation one e4m3 step apart, a few in thousands at most) separates
them. On these checkpoints they agree to ~1e-6 where the FP8 error is ~0.3.
"""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fuseformer
import fuseformer.ops as F
from fuseformer.layers import RMSNorm
from fuseformer.layers.fp8 import FP8_DTYPE, Fp8GatedMLP, Fp8Linear, Fp8RMSNorm
from fuseformer.models import quantization as Q
from fuseformer.models.loader import load_model
from fuseformer.models.registry import supported_architectures
from fuseformer.testing import assert_close, max_err, packed_logits


@pytest.fixture(autouse=True)
def _reference_ops():
    """The FP8 ops' PyTorch references: the kernels are checked against them bit for bit (and under
    DESIGN.md §3) in tests/ops/test_fp8.py; here the modules and the loader are, without the interpreter's
    cost; tests/engine/test_llm_fp8.py runs them end to end."""
    with fuseformer.use_backend("reference"):
        yield


_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FP8_MAX = 448.0


def _quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's FP8 weight as the exporters write it: scale = amax / 448 per tensor (shape ())
    or per row (N, 1), q = w / scale in e4m3."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax.float() / _FP8_MAX).clamp_min(1e-12)
    return (w.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE), scale


def _quantized(name: str, ignore: tuple[str, ...]) -> bool:
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and module.rsplit(".", 1)[-1] in _PROJ and module not in ignore


def make_fp8_checkpoint(src, dst, fmt: str, *, scale_name="weight_scale", per_channel=False, ignore=(), kv=True):
    """Rewrite the checkpoint ``src`` into an FP8 one at ``dst`` (format ``fmt``: "fp8" or
    "compressed-tensors"); modules in ``ignore`` keep their weights. Returns (dst, {weight name: its
    dequantized value}, {layer: (k_scale, v_scale)})."""
    dst = shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    dequantized, kv_scales = {}, {}
    for name in list(tensors):
        if not _quantized(name, ignore):
            continue
        q, scale = _quantize(tensors[name], per_channel)
        module = name.removesuffix(".weight")
        tensors[name] = q
        if fmt == "compressed-tensors":
            scale = scale.reshape(-1, 1) if per_channel else scale.reshape(1)
        tensors[f"{module}.{scale_name}"] = scale
        dequantized[name] = q.float() * scale.reshape(-1, 1)
    config = json.loads((dst / "config.json").read_text())
    for i in range(config["num_hidden_layers"]) if kv else ():
        k, v = torch.tensor(0.5 + 0.1 * i), torch.tensor(0.25 + 0.1 * i)
        kv_scales[i] = (k.item(), v.item())
        if fmt == "fp8":
            tensors[f"model.layers.{i}.self_attn.k_scale"], tensors[f"model.layers.{i}.self_attn.v_scale"] = k, v
        else:
            tensors[f"model.layers.{i}.self_attn.k_proj.output_scale"] = k.reshape(1)
            tensors[f"model.layers.{i}.self_attn.v_proj.output_scale"] = v.reshape(1)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head", *ignore]}
    else:
        qc = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "channel" if per_channel else "tensor",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head", *ignore],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        }
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    return dst, dequantized, kv_scales


class _FakeQuant:
    """Forward pre-hooks on an HF model's decoder linears quantizing their input as FP8 inference
    does (per token; down_proj per group of 128), through the ops' quantize/dequantize."""

    def __init__(self, hf, plain=()):
        self.handles = []
        for name, m in hf.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(m, torch.nn.Linear) and leaf in _PROJ and name not in plain:
                group = 128 if leaf == "down_proj" else None
                self.handles.append(m.register_forward_pre_hook(lambda _, a, g=group: (self.fake(a[0], g),)))

    @staticmethod
    def fake(x, group):
        q, s = F.quantize_fp8(x.float(), group_size=group)
        return F.dequantize_fp8(q, s, x.dtype)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _dequantized_hf(hf, weights: dict[str, torch.Tensor]):
    hf = copy.deepcopy(hf)
    sd = hf.state_dict()
    hf.load_state_dict(sd | {n: w.to(sd[n].dtype) for n, w in weights.items()})
    return hf


def _check_logits(name, model, hf, ids, plain=()):
    """Our FP8 logits against the dequantized HF model (reference fp64, baseline fp32 with FP8 activations
    except into the linears ``plain``, which run unquantized in ours too)."""
    (out,) = packed_logits(model, [ids])
    with torch.no_grad():
        ref = copy.deepcopy(hf).double()(ids[None]).logits[0]
        with _FakeQuant(hf, plain):
            base = hf(ids[None]).logits[0]
    assert_close(name, out, ref, base)
    fp8_error, off_baseline = max_err(base, ref), max_err(out, base)
    assert off_baseline <= 0.1 * fp8_error, (
        f"{name}: {off_baseline:.3g} off the FP8 baseline (FP8 error {fp8_error:.3g})"
    )
    return out, ref


def _assert_fp8_layers(model, config, attention=True, mlp=True, layers=None):
    for i in layers if layers is not None else range(config.num_hidden_layers):
        layer = model.model.layers[i]
        assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) == attention, i
        assert isinstance(layer.self_attn.o_proj, Fp8Linear), i
        assert isinstance(layer.mlp, Fp8GatedMLP) == mlp, i
        assert isinstance(layer.input_layernorm, Fp8RMSNorm) == attention, i
    assert type(model.model.norm) is RMSNorm and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize(
    "name, fmt, scale_name, per_channel",
    [
        ("llama3", "fp8", "weight_scale", False),
        ("qwen2", "fp8", "weight_scale_inv", False),
        ("qwen3", "compressed-tensors", "weight_scale", False),
        ("llama3", "compressed-tensors", "weight_scale", True),
    ],
)
def test_fp8_checkpoint_loads_and_matches_the_dequantized_model(
    name, fmt, scale_name, per_channel, hf_checkpoint, tmp_path
):
    src, hf = hf_checkpoint(name)
    path, weights, kv = make_fp8_checkpoint(src, tmp_path / "fp8", fmt, scale_name=scale_name, per_channel=per_channel)
    model, config = load_model(path)  # quantization=None: the checkpoint's
    _assert_fp8_layers(model, config)
    # Per-tensor q/k/v scales differ: each part's scale is on its own rows of the packed qkv.
    layer = model.model.layers[0]
    q_rows = config.num_attention_heads * config.head_dim
    w = weights["model.layers.0.self_attn.k_proj.weight"]
    torch.testing.assert_close(layer.self_attn.qkv_proj.dequantized_weight()[q_rows : q_rows + w.shape[0]], w)
    for i, (k, v) in kv.items():
        attn = model.model.layers[i].self_attn
        assert attn.k_scale.dtype == torch.float32 and attn.k_scale.item() == pytest.approx(k)
        assert attn.v_scale.item() == pytest.approx(v)
    ids = torch.randint(0, config.vocab_size, (13,))
    _check_logits(f"{name} {fmt}", model, _dequantized_hf(hf, weights), ids)


def test_ignored_modules_stay_in_dtype_and_partly_fp8_modules_are_dequantized(hf_checkpoint, tmp_path):
    """Layer 0's v_proj and layer 1's down_proj are left unquantized by the checkpoint (its ignore
    list): layer 0's qkv_proj and layer 1's MLP stay plain, their FP8 parts dequantized at load; the
    norm before each stays plain too."""
    src, hf = hf_checkpoint("llama3")
    ignore = ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj")
    path, weights, _ = make_fp8_checkpoint(src, tmp_path / "fp8", "compressed-tensors", ignore=ignore)
    model, config = load_model(path)
    _assert_fp8_layers(model, config, attention=False, layers=[0])
    _assert_fp8_layers(model, config, mlp=False, layers=[1])
    assert isinstance(model.model.layers[1].post_attention_layernorm, RMSNorm)
    assert isinstance(model.model.layers[0].post_attention_layernorm, Fp8RMSNorm)
    q_rows = config.num_attention_heads * config.head_dim
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.dtype == torch.float32
    torch.testing.assert_close(qkv[:q_rows], weights["model.layers.0.self_attn.q_proj.weight"], rtol=0, atol=0)
    plain = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    plain += [f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    ids = torch.randint(0, config.vocab_size, (9,))
    _check_logits("llama3 partly fp8", model, _dequantized_hf(hf, weights), ids, plain)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "gemma2"])
def test_bf16_checkpoint_quantized_at_load_is_quantize_then_load(name, hf_checkpoint):
    """quantization="fp8" on a plain checkpoint quantizes each tensor as it is read: the same buffers as
    loading it, then quantize_model_fp8; its logits match the model with dequantized weights."""
    path, hf = hf_checkpoint(name)
    model, config = load_model(path, quantization="fp8")
    plain, _ = load_model(path)
    Q.quantize_model_fp8(plain, config)
    ours, theirs = model.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key].float(), theirs[key].float()), key
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    weights = {}
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj.dequantized_weight()
        q, k, _ = (config.num_attention_heads * config.head_dim, *[config.num_key_value_heads * config.head_dim] * 2)
        weights |= dict(
            zip([f"{pre}self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")], qkv.split([q, k, k]))
        )
        weights[f"{pre}self_attn.o_proj.weight"] = layer.self_attn.o_proj.dequantized_weight()
        gate, up = layer.mlp.gate_up_proj.dequantized_weight().chunk(2)
        weights |= {f"{pre}mlp.gate_proj.weight": gate, f"{pre}mlp.up_proj.weight": up}
        weights[f"{pre}mlp.down_proj.weight"] = layer.mlp.down_proj.dequantized_weight()
    _check_logits(
        f"{name} quantized at load", model, _dequantized_hf(hf, weights), torch.randint(0, config.vocab_size, (11,))
    )


def test_gemma2_norms_that_feed_residual_adds_stay(hf_checkpoint):
    path, _ = hf_checkpoint("gemma2")
    model, config = load_model(path, quantization="fp8")
    for layer in model.model.layers:
        assert isinstance(layer.input_layernorm, Fp8RMSNorm) and isinstance(layer.pre_feedforward_layernorm, Fp8RMSNorm)
        assert layer.input_layernorm.offset == 1.0
        assert type(layer.post_attention_layernorm) is RMSNorm and type(layer.post_feedforward_layernorm) is RMSNorm
        assert isinstance(layer.mlp, Fp8GatedMLP) and layer.mlp.act == "gelu_tanh"


def test_every_architecture_has_an_fp8_plan():
    assert set(Q.FP8_NORMS) == set(supported_architectures())


def test_quantize_model_fp8_is_idempotent_and_keeps_names(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    model, config = load_model(path)
    names = [n for n, _ in model.named_modules()]
    Q.quantize_model_fp8(model, config)
    assert [n for n, _ in model.named_modules()] == names  # the engine finds every module where it was
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Q.quantize_model_fp8(model, config)
    assert all(torch.equal(before[k].float(), v.float()) for k, v in model.state_dict().items())
    assert Q.is_fp8_model(model)


def _with_config(path, **qc_changes):
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    for key, value in qc_changes.items():
        target = qc
        *parents, leaf = key.split("__")
        for p in parents:
            target = target[p]
        target[leaf] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "fmt, change, match",
    [
        ("fp8", dict(quant_method="awq"), r"quant_method 'awq' is not supported; .*'fp8' and 'compressed-tensors'"),
        ("fp8", dict(weight_block_size=[128, 128]), r"weight_block_size \[128, 128\]: block-wise"),
        ("fp8", dict(activation_scheme="static"), r'activation_scheme "static"'),
        (
            "compressed-tensors",
            dict(config_groups__group_0__weights__strategy="block"),
            r"weights\.strategy 'block' is not supported",
        ),
        (
            "compressed-tensors",
            dict(config_groups__group_0__weights__type="int", config_groups__group_0__weights__num_bits=4),
            r"weights is 4-bit int: only FP8",
        ),
        (
            "compressed-tensors",
            dict(config_groups__group_0__input_activations__dynamic=False),
            r"input_activations\.dynamic false",
        ),
        ("compressed-tensors", dict(sparsity_config={"format": "sparse-24"}), "sparsity_config"),
    ],
)
def test_unsupported_quantization_configs_are_named(fmt, change, match, hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama3")
    path, _, _ = make_fp8_checkpoint(src, tmp_path / "fp8", fmt, kv=False)
    with pytest.raises(ValueError, match=match):
        load_model(_with_config(path, **change))


def test_bad_checkpoints_and_arguments(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama3")
    with pytest.raises(ValueError, match=r"quantization must be one of None, 'fp8', got 'int8'"):
        load_model(src, quantization="int8")
    path, _, _ = make_fp8_checkpoint(src, tmp_path / "fp8", "fp8", kv=False)
    tensors = load_file(path / "model.safetensors")
    broken = dict(tensors)
    del broken["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(broken, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.self_attn\.k_proj\.weight_scale'\]"):
        load_model(path)
    broken = dict(tensors)
    broken["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(2, 3)
    save_file(broken, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj\.weight_scale has shape \(2, 3\); expected a per-tensor scale"):
        load_model(path)
    # FP8 tensors without a quantization_config saying how to read them.
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"is FP8 \(e4m3\) but .*config\.json has no quantization_config"):
        load_model(path)


def test_fp8_tensor_of_a_plain_module_needs_its_scale(hf_checkpoint, tmp_path):
    """v_proj ignored (bf16) makes layer 0's qkv plain: its e4m3 q_proj is dequantized, with its scale."""
    src, _ = hf_checkpoint("llama3")
    path, _, _ = make_fp8_checkpoint(src, tmp_path / "fp8", "fp8", ignore=("model.layers.0.self_attn.v_proj",))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"q_proj\.weight is FP8 \(e4m3\) but the checkpoint has no scale for it"):
        load_model(path)


def test_plain_models_get_unit_kv_scales(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    model, _ = load_model(path)
    for layer in model.model.layers:
        assert layer.self_attn.k_scale.item() == 1.0 and layer.self_attn.v_scale.dtype == torch.float32
        assert "self_attn.k_scale" not in "".join(model.state_dict())  # not in the state dict
