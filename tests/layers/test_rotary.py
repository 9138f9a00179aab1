"""RotaryEmbedding against transformers: inv_freq, cos/sin for every scaling type, and q/k against
HF's apply_rotary_pos_emb on the same positions."""

import pytest
import torch

import fuseformer
import fuseformer.ops as F
from fuseformer.layers import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

HEAD_DIM, HEADS, MAX_POS, THETA = 32, 2, 64, 10000.0
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def _hf(scaling, theta=THETA, head_dim=HEAD_DIM, max_pos=MAX_POS):
    params = {"rope_type": "default"} if scaling is None else dict(scaling)
    params["rope_theta"] = theta
    config = LlamaConfig(
        hidden_size=head_dim * HEADS,
        num_attention_heads=HEADS,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )
    return config, LlamaRotaryEmbedding(config)


def _ours(scaling, theta=THETA, head_dim=HEAD_DIM, max_pos=MAX_POS, **kw):
    return RotaryEmbedding(head_dim, max_pos, base=theta, scaling=scaling, **kw)


def _hf_cos_sin(hf, positions):
    """HF's cos, sin (len, D/2) in fp32 for a 1-D tensor of positions (its halves are duplicates)."""
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = hf(x, positions[None])
    half = cos.shape[-1] // 2
    torch.testing.assert_close(cos[..., :half], cos[..., half:], rtol=0, atol=0)
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_inv_freq_and_tables_match_transformers(kind, theta):
    _, hf = _hf(SCALINGS[kind], theta)
    ours = _ours(SCALINGS[kind], theta)
    assert ours.rope_type == kind and ours.attention_scaling == hf.attention_scaling == 1.0
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, rtol=0, atol=0)
    positions = torch.arange(MAX_POS)
    hf_cos, hf_sin = _hf_cos_sin(hf, positions)
    cos, sin = ours.cos_sin(MAX_POS, "cpu")
    assert cos.dtype == torch.float32 and cos.shape == (MAX_POS, HEAD_DIM // 2)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)


def test_scaled_inv_freq_really_differs_from_default():
    default = _ours(None).inv_freq
    for kind in ("linear", "llama3"):
        assert not torch.allclose(_ours(SCALINGS[kind]).inv_freq, default)
    ours = _ours(SCALINGS["dynamic"])
    cos_long, _ = ours.cos_sin(3 * MAX_POS)
    cos_default, _ = _ours(None).cos_sin(3 * MAX_POS)
    assert not torch.allclose(cos_long, cos_default)


@pytest.mark.parametrize("lengths", [[100], [70, 130, 300], [40]])
def test_dynamic_ntk_matches_transformers_for_growing_lengths(lengths):
    """HF recomputes inv_freq when the sequence grows past what it has seen; for lengths that only
    grow (decoding) its tables equal ours for the current length."""
    _, hf = _hf(SCALINGS["dynamic"])
    ours = _ours(SCALINGS["dynamic"])
    for length in lengths:
        hf_cos, hf_sin = _hf_cos_sin(hf, torch.arange(length))
        cos, sin = ours.cos_sin(length)
        torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-5)
        torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-5)
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf.config, None, seq_len=torch.tensor(length))
        torch.testing.assert_close(ours._inv_freq(torch.device("cpu"), length), expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["default", "linear", "llama3"])
def test_partial_rotary_inv_freq_matches_transformers(kind):
    """HF's partial_rotary_factor: frequencies over the first rotary_dim dims only."""
    scaling = dict(SCALINGS[kind] or {"rope_type": "default"})
    config, _ = _hf(scaling)
    config.rope_parameters["partial_rotary_factor"] = 0.5
    if kind == "default":
        dim = HEAD_DIM // 2
        expected = 1.0 / (THETA ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[kind](config, None)
    ours = _ours(SCALINGS[kind], rotary_dim=HEAD_DIM // 2)
    torch.testing.assert_close(ours.inv_freq, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("offsets", [0, 5, "tensor"])
def test_forward_matches_hf_apply_rotary_pos_emb(kind, offsets, device):
    b, s, hq, hk = 2, 7, 4, 2
    q = torch.randn(b, s, hq, HEAD_DIM, device=device)
    k = torch.randn(b, s, hk, HEAD_DIM, device=device)
    if offsets == "tensor":
        seqlen_offsets = torch.tensor([3, 11], device=device)
        position_ids = torch.arange(s, device=device)[None] + seqlen_offsets[:, None]
    else:
        seqlen_offsets = offsets
        position_ids = (torch.arange(s, device=device) + offsets)[None].expand(b, s)
    _, hf = _hf(SCALINGS[kind])
    cos, sin = hf.to(device)(q, position_ids)  # (B, S, D) fp32
    # HF's layout here is (B, S, H, D): heads on dim 2.
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    with fuseformer.use_backend("triton"):
        q_out, k_out = _ours(SCALINGS[kind]).to(device)(q, k, seqlen_offsets)
    torch.testing.assert_close(q_out, q_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_hf, rtol=1e-5, atol=1e-5)


def test_forward_varlen_matches_hf(device):
    lens, offsets = [3, 1, 5], [0, 9, 2]
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32, device=device)
    q = torch.randn(9, 4, HEAD_DIM, device=device)
    k = torch.randn(9, 2, HEAD_DIM, device=device)
    _, hf = _hf(SCALINGS["llama3"])
    position_ids = torch.cat([torch.arange(n) + o for n, o in zip(lens, offsets)]).to(device)
    cos, sin = hf.to(device)(q, position_ids[None])
    q_hf, k_hf = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    with fuseformer.use_backend("triton"):
        q_out, k_out = _ours(SCALINGS["llama3"])(
            q, k, torch.tensor(offsets, dtype=torch.int32, device=device), cu_seqlens=cu
        )
    torch.testing.assert_close(q_out, q_hf[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_hf[0], rtol=1e-5, atol=1e-5)


def test_forward_partial_and_interleaved_match_the_reference(device):
    rope = RotaryEmbedding(80, 32, rotary_dim=32, interleaved=True)
    q = torch.randn(2, 5, 3, 80, device=device, requires_grad=True)
    k = torch.randn(2, 5, 1, 80, device=device)
    with fuseformer.use_backend("triton"):
        q_out, k_out = rope(q, k, seqlen_offsets=4)
    cos, sin = rope.cos_sin(9, device)
    assert cos.shape == (9, 16)
    torch.testing.assert_close(q_out, F.apply_rotary_ref(q, cos, sin, True, 4))
    torch.testing.assert_close(k_out, F.apply_rotary_ref(k, cos, sin, True, 4))
    torch.testing.assert_close(q_out[..., 32:], q[..., 32:])
    q_out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_tables_grow_past_max_position_embeddings(device):
    rope = _ours(SCALINGS["linear"], max_pos=16)
    assert rope._cos.shape[0] == 16
    q = torch.randn(1, 3, 2, HEAD_DIM, device=device)
    with fuseformer.use_backend("triton"):
        q_out, _ = rope(q, q, seqlen_offsets=40)
    assert rope._cos.shape[0] >= 43
    fresh = _ours(SCALINGS["linear"], max_pos=64)
    cos, sin = fresh.cos_sin(43, device)
    torch.testing.assert_close(q_out, F.apply_rotary_ref(q, cos, sin, seqlen_offsets=40))
    torch.testing.assert_close(rope.cos_sin(43, device)[0], cos, rtol=0, atol=0)


def test_cos_sin_dtype_and_device(device):
    rope = _ours(None)
    cos, sin = rope.cos_sin(10, device, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.device.type == torch.device(device).type
    assert cos.shape == sin.shape == (10, HEAD_DIM // 2)
    torch.testing.assert_close(cos.float(), rope.cos_sin(10, device)[0], rtol=1e-2, atol=1e-2)


def test_module_to_dtype_keeps_fp32_tables():
    rope = _ours(None).to(torch.bfloat16)
    assert rope.cos_sin(8)[0].dtype == torch.float32
    assert rope.inv_freq.dtype == torch.float32


def test_forward_compile_fullgraph(device, compile_backend):
    rope = _ours(SCALINGS["llama3"])
    q = torch.randn(2, 5, 4, HEAD_DIM, device=device, requires_grad=True)
    k = torch.randn(2, 5, 2, HEAD_DIM, device=device)
    offsets = torch.tensor([1, 6], device=device)
    fn = lambda q, k: rope(q, k, seqlen_offsets=offsets)
    with fuseformer.use_backend("triton"):
        eager = fn(q, k)
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(q, k)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(head_dim=0, max_position_embeddings=8), "head_dim must be a positive int"),
        (dict(head_dim=32, max_position_embeddings=0), "max_position_embeddings must be positive"),
        (dict(head_dim=32, max_position_embeddings=8, rotary_dim=33), "rotary_dim must be an int in"),
        (dict(head_dim=32, max_position_embeddings=8, rotary_dim=15), "rotary_dim must be even"),
        (dict(head_dim=32, max_position_embeddings=8, base=1.0), "base must be a number above 1"),
        (dict(head_dim=32, max_position_embeddings=8, scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
        (dict(head_dim=32, max_position_embeddings=8, scaling={"rope_type": "linear"}), "needs a number 'factor'"),
        (dict(head_dim=32, max_position_embeddings=8, scaling={"type": "dynamic", "factor": -1.0}), "factor must be"),
        (
            dict(head_dim=32, max_position_embeddings=8, scaling={"rope_type": "llama3", "factor": 8.0}),
            "needs a number 'low_freq_factor'",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(**kwargs)


def test_legacy_type_key_is_accepted():
    assert _ours({"type": "linear", "factor": 2.0}).rope_type == "linear"
