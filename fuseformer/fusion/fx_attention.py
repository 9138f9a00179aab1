"""The attention patterns of the FX pass: ``q @ k^T * scale (+ causal mask) -> softmax (-> dropout)
-> @ v`` and ``F.scaled_dot_product_attention``, with their checks (head dims, masks read from one
run of the sample inputs). The node helpers and :class:`Match` are in ``fusion/fx_patterns.py``."""

from __future__ import annotations

import builtins
from typing import Any

import torch
import torch.fx as fx

from fuseformer.fusion import fx_fused
from fuseformer.fusion.fx_patterns import (
    Match,
    _arg,
    _is_float_meta,
    _meta,
    _module,
    _number,
    _op,
    _scalarish,
    _scope,
    _single_user,
    _upcast_source,
)
from fuseformer.ops.attention import MAX_HEAD_DIM


def _transposed(gm: fx.GraphModule, kt: Any) -> fx.Node | None:
    """k where kt is k.transpose(-2, -1) (or (-1, -2), (2, 3) of a 4-D k, permute(0, 1, 3, 2), k.mT)."""
    o = _op(gm, kt)
    if o == "transpose" and {_arg(kt, 1, "dim0"), _arg(kt, 2, "dim1")} in ({-2, -1}, {2, 3}):
        return kt.args[0]
    if o == "permute":
        dims = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (list, tuple)) else kt.args[1:]
        if tuple(dims) == (0, 1, 3, 2):
            return kt.args[0]
    if isinstance(kt, fx.Node) and kt.op == "call_function" and kt.target is builtins.getattr and kt.args[1] == "mT":
        return kt.args[0]
    return None


def match_attention(gm: fx.GraphModule, training: bool) -> list[Match]:
    """q @ k^T, scaled (either side of the mask, or on q), optionally masked (masked_fill or an
    additive mask), softmax(-1) (with an fp32 upcast or not), optional dropout, @ v."""
    out = []
    for sm in gm.graph.nodes:
        if _op(gm, sm) != "softmax":
            continue
        mod = _module(gm, sm)
        dim = mod.dim if mod is not None else _arg(sm, 1, "dim")
        if dim is None or len(sm.users) != 1:
            continue
        nodes, scales, mask = {sm}, [], None
        cur = sm.args[0]
        src = _upcast_source(gm, cur)
        if src is not None and len(cur.users) == 1:
            nodes.add(cur)
            cur = src
        while isinstance(cur, fx.Node) and _op(gm, cur) != "matmul" and len(cur.users) == 1:
            o = _op(gm, cur)
            if o in ("mul", "div") and len(cur.args) == 2:
                a, b = cur.args
                if o == "mul" and _scalarish(a) and not _scalarish(b):
                    a, b = b, a
                if not _scalarish(b):
                    break
                scales.append((o, b))
            elif o == "masked_fill" and mask is None and _number(_arg(cur, 2, "value")):
                mask = ("fill", cur.args[1], _arg(cur, 2, "value"))
                a = cur.args[0]
            elif o == "add" and mask is None and len(cur.args) == 2 and all(isinstance(v, fx.Node) for v in cur.args):
                a, b = cur.args
                mask = ("add", b, None)
            else:
                break
            nodes.add(cur)
            cur = a
        mm = cur
        if _op(gm, mm) != "matmul" or len(mm.users) != 1 or len(mm.args) != 2:
            continue
        q, kt = mm.args
        k = _transposed(gm, kt)
        if k is None or len(kt.users) != 1:
            continue
        nodes |= {mm, kt}
        if _op(gm, q) in ("mul", "div") and len(q.users) == 1 and len(q.args) == 2:
            a, b = q.args
            if _op(gm, q) == "mul" and _scalarish(a):
                a, b = b, a
            if _scalarish(b) and isinstance(a, fx.Node):
                scales.append((_op(gm, q), b))
                nodes.add(q)
                q = a
        cur, dropout = sm, None
        u = _single_user(cur)
        if u is not None and _op(gm, u) in ("to", "type_as", "float") and u.args[:1] == (cur,):
            nodes.add(u)
            cur = u
            u = _single_user(cur)
        if u is not None and _op(gm, u) == "dropout":
            dmod = _module(gm, u)
            dropout = (dmod.p, dmod) if dmod is not None else (_arg(u, 1, "p", 0.5), bool(_arg(u, 2, "training", True)))
            nodes.add(u)
            cur = u
            u = _single_user(cur)
        if u is None or _op(gm, u) != "matmul" or u.args[:1] != (cur,) or len(u.args) != 2:
            continue
        v = u.args[1]
        nodes.add(u)
        roles = {"q": q, "k": k, "v": v}
        for i, (_, s) in enumerate(scales):
            roles[f"scale{i}"] = s if isinstance(s, fx.Node) else None
        consts = [(o, None if isinstance(s, fx.Node) else s, f"scale{i}") for i, (o, s) in enumerate(scales)]
        m = _attention_match(gm, u, nodes, roles, consts, mask, dropout, dim, sdpa=False)
        m.scores = mm
        if mask is not None:
            m.keep = {mask[1]}
        out.append(m)
    for n in gm.graph.nodes:
        if _op(gm, n) == "sdpa" and len(n.args) >= 3:
            roles = {"q": n.args[0], "k": n.args[1], "v": n.args[2]}
            m = _attention_match(gm, n, {n}, roles, [], None, None, -1, sdpa=True)
            m.checks.insert(0, _check_sdpa_args)
            out.append(m)
    return out


def _attention_match(gm, anchor, nodes, roles, scales, mask, dropout, dim, sdpa) -> Match:
    contiguous = not all(_op(gm, u) in ("transpose", "permute") for u in anchor.users)
    holder: dict = {}

    def fused(original, idx):
        return fx_fused.FusedAttention(
            original,
            idx,
            causal=holder.get("causal", False),
            scales=scales,
            dropout=dropout,
            sdpa=anchor if sdpa else None,
            contiguous=contiguous,
        )

    what = "F.scaled_dot_product_attention" if sdpa else "matmul-softmax-matmul"
    m = Match(
        kind="attention",
        label="attention",
        anchor=anchor,
        nodes=set(nodes),
        outputs=[anchor],
        roles=roles,
        make_fused=fused,
        original=what,
        replacement="fuseformer flash_attention",
        scope=_scope(anchor),
    )
    m.holder = holder  # the checks settle causal here

    def check(m: Match, has_meta: bool, training: bool) -> str | None:
        if dropout is not None and dropout[0] > 0 and training:
            return f"dropout p={dropout[0]} on the attention weights while training (flash_attention has none)"
        if sdpa:
            holder["causal"] = _arg(anchor, 5, "is_causal", False) is True
        elif mask is not None:
            reason = _check_mask(m, mask, has_meta)
            if reason is not None:
                return reason
            holder["causal"] = True
        causal = holder.get("causal", False)
        m.original = f"{what} ({'causal' if causal else 'no mask'})"
        m.replacement = f"fuseformer flash_attention ({'causal' if causal else 'no mask'})"
        if not has_meta:
            return None
        q, k, v = (m.roles[r] for r in ("q", "k", "v"))
        if not _is_float_meta(q, k, v):
            return "q, k, v are not float tensors"
        qs, ks, vs = (_meta(t).shape for t in (q, k, v))
        d = qs[-1]
        if not 1 <= d <= MAX_HEAD_DIM or ks[-1] != d or vs[-1] != d:
            return f"head dim {d} (k {ks[-1]}, v {vs[-1]}): flash_attention takes one head dim in 1..{MAX_HEAD_DIM}"
        if len(qs) < 2 or len(ks) != len(qs) or len(vs) != len(qs) or ks[-2] != vs[-2]:
            return f"q, k, v shapes {tuple(qs)}, {tuple(ks)}, {tuple(vs)} do not line up"
        gqa = sdpa and len(qs) == 4 and qs[0] == ks[0] and ks[1] and qs[1] % ks[1] == 0
        if tuple(qs[:-2]) != tuple(ks[:-2]) and not gqa:
            return f"q and k broadcast ({tuple(qs)} against {tuple(ks)})"
        if dim not in (-1, len(qs) - 1):
            return f"softmax over dim {dim}, not the keys"
        if causal and qs[-2] != ks[-2]:
            return "causal with query length != key length (flash_attention aligns bottom-right)"
        return None

    m.checks.append(check)
    return m


def _check_sdpa_args(m: Match, has_meta: bool, training: bool) -> str | None:
    n = m.anchor
    if _arg(n, 3, "attn_mask") is not None:
        return "an attention mask that is not causal (flash_attention has no arbitrary-mask input)"
    p = _arg(n, 4, "dropout_p", 0.0)
    if not _number(p) or p > 0:
        return f"dropout_p={p} (flash_attention has no dropout)"
    if not isinstance(_arg(n, 5, "is_causal", False), bool):
        return "is_causal is not a constant"
    scale = n.kwargs.get("scale")
    if scale is not None and not _number(scale):
        return "scale is not a constant"
    return None


def _depends_on_inputs(n: fx.Node) -> bool:
    """Whether a tensor's value depends on a placeholder's values (not only on its shape)."""
    seen, stack = set(), [n]
    while stack:
        a = stack.pop()
        if a in seen or _scalarish(a):
            continue
        seen.add(a)
        if a.op == "placeholder":
            return True
        stack.extend(a.all_input_nodes)
    return False


def _check_mask(m: Match, mask: tuple, has_meta: bool) -> str | None:
    """A mask is fused only when it is the causal mask: built from buffers and shapes alone, and
    on the sample exactly causal (masked_fill of j > i with -inf or below -1e4, or an additive mask
    of 0 and -inf / below -1e4)."""
    how, node, value = mask
    if _depends_on_inputs(node):
        return "an attention mask that is an input (arbitrary; flash_attention has no mask input)"
    if not has_meta or node not in m.values:
        return "a mask whose values could not be read (no sample inputs)"
    scores = _meta(m.scores)
    val = m.values[node]
    if not isinstance(val, torch.Tensor) or scores is None:
        return "a mask that is not a tensor"
    sq, sk = scores.shape[-2], scores.shape[-1]
    if sq < 2:
        return "a sample too short (one query) to tell a causal mask from another"
    try:
        full = val.expand(scores.shape).reshape(-1, sq, sk)
    except RuntimeError:
        return "a mask that does not broadcast to the scores"
    above = torch.ones(sq, sk, dtype=torch.bool, device=val.device).triu(1)
    if how == "fill":
        if not value <= -1e4:
            return f"masked_fill with {value}, not -inf"
        ok = full.dtype == torch.bool and bool((full == above).all())
    else:
        ok = full.is_floating_point() and bool((full[:, ~above] == 0).all()) and bool((full[:, above] <= -1e4).all())
    if not ok:
        return "an additive or filled mask that is not causal (flash_attention has no arbitrary-mask input)"
    return None
