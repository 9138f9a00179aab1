"""fuseformer's flash attention as a Hugging Face transformers attention function.

transformers (5.x) looks up each attention module's kernel by name,
``ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]``; :func:`register` adds ``"fuseformer"``
to that registry (and to the mask registry, so that a model *loaded* with
``attn_implementation="fuseformer"`` still gets its masks). Registration is one global registry
entry and changes nothing by itself: only attention modules whose config names ``"fuseformer"`` use
it. The fusion pass (``fusion/hf.py``) gives each attention module it replaces its own shallow copy
of the config naming it, so one layer can be reverted without the others, and two models in one
process can differ.

The masks stay the model's own: the model keeps building them for its own implementation (sdpa's
boolean 4D mask or None, eager's additive 4D mask, flash-attention-2's 2D padding mask), and
:func:`fuseformer_attention` reads them. A 4D mask is reduced to what the kernel takes, once per
mask tensor (all layers share it): the keys and queries that any position sees (padding, left,
right or in the middle after a right-padded prompt, and unfilled static-cache slots drop out), and
a check that the mask restricted to those is exactly bottom-right causal (with the layer's sliding
window), which is what the kernel computes. Then the kernel runs batched (B, S, H, D) when nothing
drops out, or packed varlen (T, H, D) with cu_seqlens otherwise. A mask of any other shape
(bidirectional, packed documents, a custom 4D mask) fails the check and runs on an exact masked
reference instead: slower, never wrong. So does attention dropout in training, which the kernel
lacks (the pass skips those models; this is the safety net). Logit soft-capping (Gemma 2's
``softcap``) the kernel takes, in the forward and the backward.

KV cache: transformers updates the cache before calling the attention function, so the function
sees all keys; causal alignment is bottom-right (query i of Sq sees keys j <= i + Sk - Sq), the same
as the masks transformers builds for a cache, and as flash-attn's.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as tnf

import fuseformer.ops as F
from fuseformer.ops.attention import attention_mask as _window_mask

NAME = "fuseformer"
MAX_HEAD_DIM = 256

_registered = False


def register() -> str:
    """Add ``"fuseformer"`` to transformers' attention (and mask) registries; returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, fuseformer_attention)
        try:  # the mask a model loaded with attn_implementation="fuseformer" builds: sdpa's form
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionMaskInterface.register(NAME, sdpa_mask)
        except ImportError:  # pragma: no cover - every 5.x has both
            pass
        _registered = True
    return NAME


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A 4D mask as booleans, True = visible (sdpa's bool mask, or eager's additive 0 / min)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _plan_4d(mask: torch.Tensor, b: int, sq: int, sk: int, left: int):
    """What the kernel needs to compute what ``mask`` (B|1, 1|H, Sq, Sk+) allows, or None when it
    cannot: the mask is not bottom-right causal (+ window ``left``) on the rows it keeps.

    A row is kept when it sees a key no earlier row sees (its own token: a real query in a causal
    mask). The other rows that see anything are padding queries after the last token (right
    padding), which see every kept key of their sequence: they run as a second, non-causal varlen
    call over the same keys, so they match the original exactly too. Rows that see nothing give 0.
    """
    valid = _bool_mask(mask)[..., :sk]
    if valid.shape[1] != 1:
        if not torch.equal(valid, valid[:, :1].expand_as(valid)):
            return None
    valid = valid[:, 0].expand(b, sq, sk)  # (B, Sq, Sk)
    cols = torch.arange(sk, device=valid.device)
    last = torch.where(valid, cols, -1).amax(-1)  # (B, Sq) the last key each row sees, -1: none
    before = tnf.pad(last.cummax(1).values[:, :-1], (1, 0), value=-1)
    kept = last > before  # (B, Sq)
    seen = valid & kept[:, :, None]
    kv_keep = seen.any(1)  # (B, Sk)
    nq, nk = kept.sum(1), kv_keep.sum(1)
    rq, rk = kept.cumsum(1) - 1, kv_keep.cumsum(1) - 1  # ranks among the kept ones
    diff = rk[:, None, :] - rq[:, :, None] - (nk - nq)[:, None, None]  # j' - (i' + Sk' - Sq')
    expected = kept[:, :, None] & kv_keep[:, None, :] & (diff <= 0)
    if left >= 0:
        expected &= diff >= -left
    if not torch.equal(expected, seen):
        return None
    extra = ~kept & valid.any(2)  # (B, Sq) right-padding queries
    has_extra = bool(extra.any())
    if has_extra and not torch.equal(valid & extra[:, :, None], extra[:, :, None] & kv_keep[:, None, :]):
        return None
    if not has_extra and bool(kept.all()) and bool(kv_keep.all()):
        return ("dense",)
    return _varlen_plan(kept, kv_keep, extra if has_extra else None)


def _varlen_plan(q_keep: torch.Tensor, kv_keep: torch.Tensor, extra: torch.Tensor | None = None):
    nq, nk = q_keep.sum(1), kv_keep.sum(1)
    cu_q = tnf.pad(nq.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = tnf.pad(nk.cumsum(0), (1, 0)).to(torch.int32)
    q_idx = q_keep.flatten().nonzero().squeeze(1)
    kv_idx = kv_keep.flatten().nonzero().squeeze(1)
    extra_plan = None
    if extra is not None:
        ne = extra.sum(1)
        cu_e = tnf.pad(ne.cumsum(0), (1, 0)).to(torch.int32)
        extra_plan = (extra.flatten().nonzero().squeeze(1), cu_e, int(ne.max()))
    return ("varlen", q_idx, kv_idx, cu_q, cu_k, int(nq.max()), int(nk.max()), extra_plan)


def _plan(mask: torch.Tensor | None, b: int, sq: int, sk: int, left: int, causal: bool):
    if mask is None:
        return ("dense",) if causal or sq == 1 else ("full",)
    if mask.dim() == 2:  # flash-attention-2 form: (B, Sk) padding, 1 = token; causal bottom-right
        kv_keep = mask[:, -sk:].bool()
        q_keep = kv_keep[:, -sq:]
        if bool(kv_keep.all()):
            return ("dense",)
        return _varlen_plan(q_keep, kv_keep)
    if mask.dim() != 4 or not causal:
        return None
    if torch.compiler.is_compiling():
        return _plan_4d(mask, b, sq, sk, left)
    # Every layer of a forward gets the same mask tensor: reduce it once.
    key = (b, sq, sk, left)
    plans = mask.__dict__.setdefault("_fuseformer_plans", {})
    if key not in plans:
        plans[key] = _plan_4d(mask, b, sq, sk, left)
    return plans[key]


def _reference(q, k, v, mask, scale, left, causal, softcap, dropout, training):
    """Exact masked attention in fp32 (the safety net): q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D)."""
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    rep = hq // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        valid = _window_mask(sq, sk, causal, (left, 0 if causal else -1), q.device) if causal or left >= 0 else None
    elif mask.dim() == 2:
        valid = mask[:, None, None, -sk:].bool() & _window_mask(sq, sk, True, (left, 0), q.device)
    else:
        valid = _bool_mask(mask)[..., :sk]
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if dropout and training:
        probs = tnf.dropout(probs, p=dropout)
    out = torch.matmul(probs, vf).to(q.dtype)
    return out.transpose(1, 2).contiguous()  # (B, Sq, Hq, D)


def config_swap(module: torch.nn.Module, impl: str):
    """(apply, undo) that give ``module`` a shallow copy of its config naming attention
    implementation ``impl``, and put the shared config back: one layer switched, not the model."""
    state: dict = {}

    def apply() -> None:
        if "original" in state:
            return
        state["original"] = module.config
        own = copy.copy(module.config)
        # Set the field itself: the property's setter would also rename the shared sub-configs.
        own.__dict__["_attn_implementation_internal"] = impl
        module.config = own

    def undo() -> None:
        if "original" in state:
            module.config = state.pop("original")

    return apply, undo


try:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as _HF_SDPA
except ImportError:  # pragma: no cover (every transformers 5.x has it)
    _HF_SDPA = None


def fuseformer_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D)
    (the cache already updated), ``attention_mask`` as the model built it; returns
    (out (B, Sq, Hq, D), None)."""
    b, hq, sq, d = query.shape
    sk = key.shape[2]
    softcap = softcap or 0.0
    if sq == 1 and not softcap and _HF_SDPA is not None:
        # A decode step: transformers' own SDPA call, as the model ran before optimize. Ours has no
        # split-K path over a dense cache, and reading the mask per step syncs the host and makes
        # torch.compile recompile: run 111 (H200, 8B shape, batch 1) gave 12 / 28 tok/s (static /
        # dynamic cache) against HF's 119 / 42 with our attention on decode steps.
        return _HF_SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    left = sliding_window - 1 if sliding_window else -1
    causal = getattr(module, "is_causal", True)
    training = module.training
    if (
        (sq == 1 and softcap)  # a soft-capped decode step (SDPA has no cap): one row of scores, as eager
        or (dropout and training)
        or kwargs.get("s_aux") is not None
        or d > MAX_HEAD_DIM
        or hq % key.shape[1]
        or (attention_mask is not None and not isinstance(attention_mask, torch.Tensor))
    ):
        return _reference(query, key, value, attention_mask, scale, left, causal, softcap, dropout, training), None
    plan = _plan(attention_mask, b, sq, sk, left, causal)
    if plan is None:
        return _reference(query, key, value, attention_mask, scale, left, causal, softcap, dropout, training), None
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D)
    if plan[0] in ("dense", "full"):
        out = F.flash_attention(
            q, k, v, causal=plan[0] == "dense", softmax_scale=scale, window_size=(left, -1), softcap=softcap
        )
        return out, None
    _, q_idx, kv_idx, cu_q, cu_k, max_q, max_k, extra = plan
    hkv = k.shape[2]
    qp = q.reshape(b * sq, hq, d).index_select(0, q_idx)  # (Tq, Hq, D)
    kp = k.reshape(b * sk, hkv, d).index_select(0, kv_idx)  # (Tk, Hkv, D)
    vp = v.reshape(b * sk, hkv, d).index_select(0, kv_idx)
    outp = F.flash_attention(
        qp,
        kp,
        vp,
        causal=True,
        softmax_scale=scale,
        window_size=(left, 0),
        softcap=softcap,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )
    # Rows that see nothing (left-padding queries) are 0, as flash-attention-2 in transformers gives.
    out = outp.new_zeros(b * sq, hq, d).index_copy(0, q_idx, outp)
    if extra is not None:  # right-padding queries: each sees all kept keys of its sequence
        e_idx, cu_e, max_e = extra
        oute = F.flash_attention(
            q.reshape(b * sq, hq, d).index_select(0, e_idx),
            kp,
            vp,
            causal=False,
            softmax_scale=scale,
            softcap=softcap,
            cu_seqlens_q=cu_e,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_e,
            max_seqlen_k=max_k,
        )
        out = out.index_copy(0, e_idx, oute)
    return out.view(b, sq, hq, d), None


# ---------------------------------------------------------------------------------------------
# Rotary + attention: a Llama-family attention module's whole forward
# ---------------------------------------------------------------------------------------------
# The attention modules whose forward :func:`rotary_attention_forward` reproduces: q/k/v projections,
# (Qwen3: a per-head RMSNorm of q and k), rotate_half RoPE from the model's (cos, sin), the cache
# update, attention, o_proj. Their rotary embeddings build cos/sin as cat(freqs, freqs), so the first
# half of the last dim is the table the rotary kernel takes.
ROTARY_CLASSES = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"})


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D) rotated by HF's position embeddings cos/sin (B | 1, S, R), R <= D: one kernel.
    With B rows of positions the batch is one sequence of B * S tokens whose position p indexes row p
    of the (B * S, R / 2) table, so each (b, s) gets its own row (left padding, any position_ids)
    with no offsets to check."""
    b, s, h, d = x.shape
    half = cos.shape[-1] // 2
    if cos.shape[0] == 1:  # one row of positions for the whole batch (position_ids broadcast)
        return F.apply_rotary(x, cos[0, :, :half], sin[0, :, :half])
    table_cos = cos.reshape(b * s, -1)[:, :half]
    table_sin = sin.reshape(b * s, -1)[:, :half]
    return F.apply_rotary(x.reshape(1, b * s, h, d), table_cos, table_sin).view(b, s, h, d)


def rotary_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """LlamaAttention.forward (and Mistral's, Qwen2's, Qwen3's) with RoPE in one kernel per q and k on
    the projections' own (B, S, H, D) layout, so that the attention kernel reads them without the
    transposes and copies of HF's rotate_half. The cache is updated as the class's forward does it:
    forwards with a ``cache_position`` parameter (transformers 4.x) pass it in a dict; later ones take
    the cache as ``past_key_values`` (5.17) or ``cache`` (5.25) and pass the call's kwargs
    (``self.__dict__`` says which)."""
    state = self.__dict__["_fuseformer_rotary"]
    b, s = hidden_states.shape[:-1]
    shape = (b, s, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape)
    k = self.k_proj(hidden_states).view(shape)
    v = self.v_proj(hidden_states).view(shape)
    if state["qk_norm"]:
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    key, value = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, S, D) views, as HF's cache takes them
    if state["cache_position"]:
        cache = kwargs.pop("past_key_values", None)
        cache_position = kwargs.pop("cache_position", None)
        if cache is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key, value = cache.update(key, value, self.layer_idx, cache_kwargs)
    else:
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    window = state["window"] and getattr(self.config if state["window"] == "config" else self, "sliding_window", None)
    out, _ = fuseformer_attention(
        self, q.transpose(1, 2), key, value, attention_mask,
        dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling, sliding_window=window,
        **kwargs,
    )  # fmt: skip
    return self.o_proj(out.reshape(b, s, -1)), None


def rotary_state(attn: torch.nn.Module) -> dict | None:
    """What :func:`rotary_attention_forward` needs to know of ``attn``'s class, or None when it does not
    reproduce that class's forward."""
    import inspect

    if type(attn).__name__ not in ROTARY_CLASSES:
        return None
    if not all(isinstance(getattr(attn, n, None), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return None
    params = inspect.signature(type(attn).forward).parameters
    qk_norm = type(attn).__name__ == "Qwen3Attention"
    if qk_norm and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
        return None
    return dict(
        qk_norm=qk_norm,
        cache_position="cache_position" in params,
        # What the class passes as sliding_window: Qwen2's and Qwen3's per-layer attribute, Mistral's config.
        window={"LlamaAttention": None, "MistralAttention": "config"}.get(type(attn).__name__, "module"),
    )
