"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): one plain model for the four architectures.

The forward takes a flattened varlen batch, the engine's step: input_ids (T,), positions (T,) and an
``AttentionMetadata``. Q/K/V and gate/up are packed into one Linear each (models/loader.py packs the
checkpoint's weights). Parameter names follow Hugging Face's, except the packed ``qkv_proj`` and
``gate_up_proj``. Fusion, compile and parallelism are applied from outside (STYLE.md §4).
"""

from __future__ import annotations

import torch
from torch import nn

import fuseformer.ops as F
from fuseformer.layers import Linear, RMSNorm
from fuseformer.layers.rotary import rope_inv_freq as _rope_inv_freq
from fuseformer.models.attention_metadata import AttentionMetadata  # also re-exported: its old home
from fuseformer.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig, seq_len: torch.Tensor | None = None) -> torch.Tensor:
    """(D/2,) fp32 inverse frequencies of ``config``'s rope (default, linear, llama3, dynamic), by
    :func:`fuseformer.layers.rotary.rope_inv_freq`; for dynamic, ``seq_len`` of any shape (e.g. (T,)
    per token) gives (*seq_len.shape, D/2)."""
    rs = config.rope_scaling or {"rope_type": "default"}
    return _rope_inv_freq(
        config.head_dim, config.rope_theta, rs["rope_type"], rs, config.max_position_embeddings, seq_len
    )


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (T, H, D), cos/sin (T, D/2) per token: seen as one sequence of T tokens at offset 0.
    return F.apply_rotary(x.unsqueeze(0), cos, sin).squeeze(0)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.window = layer, config.window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        # Gemma2 scales by query_pre_attn_scalar**-0.5 and soft-caps the scores (0: no cap).
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping or 0.0
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # The FP8 KV cache's per-layer K and V scales (stored = k / k_scale in e4m3): fp32 scalars on
        # the model's device, 1.0 unless the loader fills them from the checkpoint (``fill_``, ``copy_``).
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(dtype) would cast the scales and to_empty (the loader's meta build) leave them garbage:
        # keep their values in fp32 (1.0 out of the meta device); only their device follows ``fn``.
        scales = None if self.k_scale.is_meta else torch.stack((self.k_scale, self.v_scale)).float()
        super()._apply(fn, recurse)
        device = self.k_scale.device
        scales = torch.ones(2, device=device) if scales is None else scales.to(device)
        self.k_scale, self.v_scale = scales[0].clone(), scales[1].clone()
        return self

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.split, dim=-1)  # (T, Hq*D), (T, Hkv*D) x2: strided views
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # Qwen3: RMSNorm over each head's D before rotary
            # As (rows, D): a copy out of the strided qkv views (rows_2d's view-or-copy fallback
            # breaks torch.compile's fullgraph).
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
            q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        else:
            # q and k are adjacent in each qkv row: one rotary call over their Hq + Hkv heads (a strided
            # view), then split (one op call instead of two: a decode step's cost on a CPU is per call).
            qk = qkv[:, : (self.num_heads + self.num_kv_heads) * self.head_dim]
            qk = _rotary(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)  # (T, Hq, D), (T, Hkv, D)
        if meta.kv_caches is None:  # causal within each packed sequence, over the new tokens only
            cu, n = meta.cu_seqlens_q, meta.max_seqlen_q
            window = (self.window - 1, 0) if self.window > 0 else (-1, -1)
            o = F.flash_attention(q, k, v, True, self.scale, window, cu, cu, n, n, softcap=self.softcap)
        elif meta.split is not None:  # the engine's graph pieces attend between them
            o = meta.split(self, q, k, v)
        else:
            o = self.attend_cache(q, k, v, meta)
        return self.o_proj(o.reshape(t, -1))

    def attend_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write the new tokens' k, v (T, Hkv, D) into this layer's paged cache, then attend q (T, Hq, D)
        over the cache -> (T, Hq, D)."""
        k_cache, v_cache = meta.kv_caches[self.layer]
        F.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return F.paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
            self.scale, causal=True, window=self.window, max_seqlen_q=meta.max_seqlen_q, softcap=self.softcap,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.act = config.hidden_act  # "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU): fused_mlp's names
        # rows [0, I) gate, [I, 2I) up
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The gate-up GEMM with act * mul in its epilogue, then the down GEMM; for inference at up to
        # 64 tokens (decode steps) both as GEMMs that stream the weights at ~89% of copy bandwidth
        # where nn.Linear + swiglu + nn.Linear reaches 72-79% (BENCHMARKS.md, run 108).
        return F.fused_mlp(x, self.gate_up_proj.weight, self.down_proj.weight, self.act)


class DecoderLayer(nn.Module):
    norm_offset = 0.0  # the norms scale by (norm_offset + weight); Gemma's subclass sets 1

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = self.new_norm(config)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = self.new_norm(config)
        self.mlp = MLP(config)

    @classmethod
    def new_norm(cls, config: ModelConfig) -> RMSNorm:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, offset=cls.norm_offset)

    def forward(self, hidden, residual, cos, sin, meta):
        # The residual add before each norm is fused into it: (norm(h + r), h + r).
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_class: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = layer_class.new_norm(config)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Keep the rotary frequencies fp32 and computed, whatever .to(dtype) or to_empty did to the buffer.
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def rotary_cos_sin(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) positions -> cos, sin (T, D/2) fp32, as HF computes them (position * inv_freq in fp32)."""
        inv_freq = self.inv_freq[None, :]
        rs = self.config.rope_scaling
        if rs is not None and rs["rope_type"] == "dynamic":
            # Each token takes the frequencies of its own sequence's length (context with the cache),
            # as HF generating that sequence alone would; no host sync.
            q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
            seq_lens = meta.context_lens if meta.context_lens is not None else q_lens
            per_token = torch.repeat_interleave(seq_lens, q_lens, output_size=positions.shape[0])
            inv_freq = rope_inv_freq(self.config, per_token)  # (T, D/2)
        freqs = positions[:, None].float() * inv_freq
        return freqs.cos(), freqs.sin()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, H) input hidden states."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)  # (T, H)
        cos, sin = self.rotary_cos_sin(positions, meta)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The model for LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM."""

    base_model_class: type[LlamaModel] = LlamaModel  # the decoder stack; a subclass names its own

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.base_model_class(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) int64 of a flattened varlen batch -> hidden states (T, H)."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (N, V) of the rows ``indices`` (N,) of hidden (T, H) (e.g. each sequence's last
        token), or of every row when None."""
        if indices is not None:
            hidden = hidden[indices]
        return self.lm_head(hidden)
