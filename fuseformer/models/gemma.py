"""Gemma and Gemma2 decoders: one plain model for both, built from the Llama blocks of models/llama.py.

What differs from Llama (transformers 5.25's modeling_gemma.py and modeling_gemma2.py):

- every RMSNorm scales by ``(1 + weight)``, formed in fp32 (``RMSNorm(offset=1)``);
- the MLP is GeGLU (``config.hidden_act`` "gelu_tanh", HF's gelu_pytorch_tanh);
- the embeddings are multiplied by sqrt(hidden_size), rounded to the embedding's dtype first as HF
  does (in bf16, sqrt(3072) = 55.4256 becomes 55.5);
- tied embeddings by default.

Gemma2 adds, all read from the ModelConfig by the shared attention and here:

- a post-attention and a post-feedforward norm: each sublayer's output is normalized before it joins
  the residual stream (four norms per layer instead of two);
- softmax scale ``query_pre_attn_scalar**-0.5`` and attention logit soft-capping
  (``cap * tanh(s / cap)`` before the mask and softmax), in llama.Attention;
- a sliding window in the layers ``config.layer_types`` marks (by default the even ones);
- final logit soft-capping in :meth:`GemmaForCausalLM.compute_logits`.

The interface is LlamaForCausalLM's: forward(input_ids, positions, meta) over a flattened varlen
batch, compute_logits, checkpoint parameter names except the packed qkv_proj and gate_up_proj.
"""

from __future__ import annotations

import torch

from fuseformer.models.config import ModelConfig
from fuseformer.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel

# The dtypes a model may run in: sqrt(hidden_size) is rounded to each as HF rounds its fp32 buffer.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class GemmaDecoderLayer(DecoderLayer):
    """Llama's layer with Gemma's offset norms: h + attn(norm(h)), then h + mlp(norm(h))."""

    norm_offset = 1.0


class Gemma2DecoderLayer(GemmaDecoderLayer):
    """Gemma2's layer: h + post_attention_norm(attn(input_norm(h))), then
    h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.pre_feedforward_layernorm = self.new_norm(config)
        self.post_feedforward_layernorm = self.new_norm(config)

    def forward(self, hidden, residual, cos, sin, meta):
        # As in DecoderLayer, the stream is hidden + residual and the add is fused into the next norm:
        # (norm(h + r), h + r). The post norms see the sublayer's output alone.
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(LlamaModel):
    def __init__(self, config: ModelConfig) -> None:
        gemma2 = config.architecture == "Gemma2ForCausalLM"
        super().__init__(config, Gemma2DecoderLayer if gemma2 else GemmaDecoderLayer)
        # HF keeps sqrt(H) as an fp32 buffer and casts it to the embedding's dtype before the product.
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32, device="cpu")  # not meta
        self.embed_scale = {dtype: scale.to(dtype).item() for dtype in _DTYPES}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, H) embeddings * sqrt(H) (the scale rounded to their dtype)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale[hidden.dtype]


class GemmaForCausalLM(LlamaForCausalLM):
    """The model for GemmaForCausalLM and Gemma2ForCausalLM."""

    base_model_class = GemmaModel

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (N, V) of the rows ``indices`` (N,) of hidden (T, H), or of every row when None;
        with ``final_logit_softcapping`` (Gemma2) capped to cap * tanh(logits / cap)."""
        logits = super().compute_logits(hidden, indices)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
