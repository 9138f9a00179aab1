"""The patterns of the FX pass (``fusion/fx.py``): matchers over a traced graph, and their checks.

A matcher walks the graph from an anchor node (an ``rsqrt``, a ``softmax``, a ``mul``, a
``cross_entropy``) and returns a :class:`Match`: the nodes that move into the fused submodule, the
ones whose values leave it, and the roles of its inputs. Matching is structural; what needs shapes,
dtypes or values (head dims, equal shapes for a residual add, whether a mask is causal) is checked
afterwards by :func:`validate` with the tensor metadata of one run of the sample inputs.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuseformer.fusion import fx_fused

_FUNCS: dict[Any, str] = {
    torch.rsqrt: "rsqrt",
    torch.sqrt: "sqrt",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.truediv: "div",
    torch.div: "div",
    torch.true_divide: "div",
    operator.add: "add",
    torch.add: "add",
    operator.pow: "pow",
    torch.pow: "pow",
    torch.mean: "mean",
    torch.square: "square",
    operator.matmul: "matmul",
    torch.matmul: "matmul",
    torch.bmm: "matmul",
    torch.softmax: "softmax",
    F.softmax: "softmax",
    torch.transpose: "transpose",
    torch.permute: "permute",
    F.silu: "silu",
    torch.sigmoid: "sigmoid",
    F.gelu: "gelu",
    F.dropout: "dropout",
    F.cross_entropy: "cross_entropy",
    F.linear: "linear",
    F.layer_norm: "layer_norm",
    F.rms_norm: "rms_norm",
    F.scaled_dot_product_attention: "sdpa",
    torch.masked_fill: "masked_fill",
    torch.reshape: "reshape",
    torch.flatten: "flatten",
}
_METHODS = {
    "mul", "div", "add", "pow", "mean", "rsqrt", "sqrt", "square", "matmul", "softmax", "transpose",
    "permute", "masked_fill", "sigmoid", "view", "reshape", "flatten", "to", "float", "type_as", "type",
}  # fmt: skip
_MODULES: tuple[tuple[type, str], ...] = (
    (nn.Linear, "linear"),
    (nn.SiLU, "silu"),
    (nn.GELU, "gelu"),
    (nn.Softmax, "softmax"),
    (nn.Dropout, "dropout"),
    (nn.LayerNorm, "layer_norm"),
    (nn.RMSNorm, "rms_norm"),
    (nn.Sigmoid, "sigmoid"),
    (nn.CrossEntropyLoss, "cross_entropy"),
)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(eq=False)
class Match:
    """One pattern found in a graph.

    nodes: what moves into the submodule; outputs: those of them whose values are used outside
    (in the order the submodule returns them); roles: role name -> an outer node, ("attr", target)
    for a parameter of a torch.nn module the match calls, or None; make_fused(original, index of
    each role among the submodule's inputs) -> the fused twin; checks: (match, has_meta, training)
    -> the reason to skip, or None; fallback: a smaller match to try when this one fails.
    """

    kind: str
    label: str
    anchor: fx.Node
    nodes: set
    outputs: list
    roles: dict
    make_fused: Callable[[nn.Module, dict], nn.Module]
    original: str
    replacement: str
    note: str = ""
    checks: list = field(default_factory=list)
    keep: set = field(default_factory=set)
    values: dict = field(default_factory=dict)
    fallback: Match | None = None
    scope: str = ""
    # Set by the pass once chosen.
    name: str = ""
    inputs: list = field(default_factory=list)
    original_module: nn.Module | None = None


def validate(m: Match, order: dict, has_meta: bool, training: bool) -> str | None:
    """Why ``m`` cannot be replaced, or None. Structure first (no node the match swallows is read
    outside it, and its outputs are read only after it), then the match's own checks."""
    last = max(order[n] for n in m.nodes)
    for n in m.nodes:
        outside = [u for u in n.users if u not in m.nodes]
        if outside and n not in m.outputs:
            return f"an intermediate value ({n.name}) is also used outside the pattern"
        if any(order[u] < last for u in outside):
            return f"{n.name} is used before the pattern ends"
    for check in m.checks:
        reason = check(m, has_meta, training)
        if reason is not None:
            return reason
    return None


# --------------------------------------------------------------------------------------------
# Node helpers
# --------------------------------------------------------------------------------------------
def _op(gm: fx.GraphModule, n: Any) -> str | None:
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_function":
        return _FUNCS.get(n.target)
    if n.op == "call_method":
        return n.target if n.target in _METHODS else None
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        for cls, name in _MODULES:
            if isinstance(mod, cls):
                return name
    return None


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _single_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _module(gm: fx.GraphModule, n: fx.Node) -> nn.Module | None:
    return gm.get_submodule(n.target) if n.op == "call_module" else None


def _scope(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return next(reversed(stack)) if stack else ""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scalarish(n: Any) -> bool:
    """A value computed from sizes and constants only (``1 / math.sqrt(q.size(-1))``): a Python
    number at run time, never a tensor."""
    if _number(n):
        return True
    if not isinstance(n, fx.Node):
        return False
    if n.op == "call_method" and n.target == "size":
        return True
    if n.op == "call_function" and n.target is builtins.getattr and n.args[1] == "shape":
        return True
    if n.op == "call_function" and (
        getattr(n.target, "__module__", None) == "math"
        or n.target in (operator.getitem, operator.mul, operator.truediv, operator.pow, operator.add, operator.sub)
        or n.target in (math.sqrt, math.pow)
    ):
        return all(_scalarish(a) or not isinstance(a, fx.Node) for a in n.args) and any(
            isinstance(a, fx.Node) for a in n.args
        )
    return False


def _upcast_source(gm: fx.GraphModule, n: Any) -> fx.Node | None:
    """x where n is x.float() / x.to(torch.float32) / x.type(torch.float32)."""
    o = _op(gm, n)
    if o == "float" or (o in ("to", "type") and torch.float32 in (*n.args[1:], n.kwargs.get("dtype"))):
        return n.args[0]
    return None


def _is_cast_to(gm: fx.GraphModule, u: fx.Node, cur: fx.Node, x: fx.Node) -> list | None:
    """The nodes of ``cur.to(x.dtype)`` / ``cur.type_as(x)`` when ``u`` is that cast, else None."""
    o = _op(gm, u)
    if u.args[:1] != (cur,):
        return None
    if o == "type_as" and u.args[1:2] == (x,):
        return [u]
    if o == "to" and len(u.args) >= 2:
        d = u.args[1]
        if (
            isinstance(d, fx.Node)
            and d.op == "call_function"
            and d.target is builtins.getattr
            and d.args == (x, "dtype")
        ):
            return [u, d] if len(d.users) == 1 else [u]
    return None


def _meta(n: Any):
    return n.meta.get("tensor_meta") if isinstance(n, fx.Node) else None


def _is_float_meta(*nodes) -> bool:
    return all(_meta(n) is not None and _meta(n).dtype in _FLOATS for n in nodes)


# --------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------
def _square_of(gm: fx.GraphModule, sq: Any) -> fx.Node | None:
    o = _op(gm, sq)
    if o == "pow" and _arg(sq, 1, "exponent") in (2, 2.0):
        return sq.args[0]
    if o == "mul" and len(sq.args) == 2 and sq.args[0] is sq.args[1]:
        return sq.args[0]
    if o == "square":
        return sq.args[0]
    return None


def _mul_other(n: fx.Node, this: Any) -> Any:
    if len(n.args) != 2:
        return None
    a, b = n.args
    return b if a is this else a if b is this else None


def match_rms_hand(gm: fx.GraphModule, training: bool) -> list[Match]:
    """x * rsqrt(mean(x^2, -1, keepdim=True) + eps) [* w], with x / sqrt(...), pow(2) / x*x /
    square, the fp32 upcast (x.float() ... .to(x.dtype) or .type_as(x)) and w on either side."""
    out = []
    for r in gm.graph.nodes:
        o = _op(gm, r)
        if o not in ("rsqrt", "sqrt"):
            continue
        s = r.args[0]
        if _op(gm, s) != "add" or len(s.args) != 2 or len(s.users) != 1 or len(r.users) != 1:
            continue
        mean, eps = (s.args[0], s.args[1]) if isinstance(s.args[0], fx.Node) else (s.args[1], s.args[0])
        if not _number(eps) or _op(gm, mean) != "mean" or len(mean.users) != 1:
            continue
        if _arg(mean, 1, "dim") not in (-1, [-1], (-1,)) or _arg(mean, 2, "keepdim", False) is not True:
            continue
        sq = mean.args[0]
        x32 = _square_of(gm, sq)
        if x32 is None or len(sq.users) != 1:
            continue
        y = _single_user(r)
        if o == "rsqrt" and not (_op(gm, y) == "mul" and _mul_other(y, r) is x32):
            continue
        if o == "sqrt" and not (_op(gm, y) == "div" and y.args[:2] == (x32, r)):
            continue
        nodes = {r, s, mean, sq, y}
        x = _upcast_source(gm, x32)
        if x is not None:
            nodes.add(x32)
        else:
            x = x32
        cur, w, cast = y, None, x is x32
        for _ in range(2):
            u = _single_user(cur)
            if u is None:
                break
            c = None if cast else _is_cast_to(gm, u, cur, x)
            if c is not None:
                nodes.update(c)
                cast, cur = True, u
                continue
            other = _mul_other(u, cur) if _op(gm, u) == "mul" and w is None else None
            if isinstance(other, fx.Node) and other.op == "get_attr":
                nodes.add(u)
                w, cur = other, u
                continue
            break
        if not cast:
            continue  # upcast but never cast back: the result is fp32, not x's dtype
        what = "x * rsqrt(mean(x^2) + eps)" if o == "rsqrt" else "x / sqrt(mean(x^2) + eps)"
        if x is not x32:
            what += " in fp32"
        out.append(_norm_match(gm, "rms_norm", r, x, nodes, cur, {"w": w}, float(eps), what + (" * w" if w else "")))
    return out


def match_norm_ops(gm: fx.GraphModule, training: bool) -> list[Match]:
    """F.rms_norm / nn.RMSNorm and F.layer_norm / nn.LayerNorm over the last dim."""
    out = []
    for n in gm.graph.nodes:
        o = _op(gm, n)
        if o not in ("rms_norm", "layer_norm"):
            continue
        mod = _module(gm, n)
        if mod is not None:
            shape, eps = tuple(mod.normalized_shape), mod.eps
            w = ("attr", f"{n.target}.weight") if mod.weight is not None else None
            b = ("attr", f"{n.target}.bias") if getattr(mod, "bias", None) is not None else None
            what = type(mod).__name__
        else:
            shape = _arg(n, 1, "normalized_shape")
            w = _arg(n, 2, "weight")
            b = _arg(n, 3, "bias") if o == "layer_norm" else None
            eps = _arg(n, 4 if o == "layer_norm" else 3, "eps", 1e-5 if o == "layer_norm" else None)
            shape = (shape,) if isinstance(shape, int) else tuple(shape) if isinstance(shape, (list, tuple)) else None
            what = f"F.{o}"
            if any(v is not None and not (isinstance(v, fx.Node) and v.op == "get_attr") for v in (w, b)):
                continue
        if shape is not None and len(shape) == 1 and _is_last_dim(shape[0], n.args[0] if n.args else None):
            shape = (None,)  # x.shape[-1] / x.size(-1): checked at run time
        if shape is None or len(shape) != 1 or not all(isinstance(d, int) or d is None for d in shape):
            continue
        if not (eps is None or _number(eps)) or len(n.args) < 1 or not isinstance(n.args[0], fx.Node):
            continue
        out.append(_norm_match(gm, o, n, n.args[0], {n}, n, {"w": w, "b": b}, eps, what, shape[0]))
    return out


def _is_last_dim(d: Any, x: Any) -> bool:
    """d is x.size(-1) or x.shape[-1]."""
    if not isinstance(d, fx.Node) or not isinstance(x, fx.Node):
        return False
    if d.op == "call_method" and d.target == "size" and d.args == (x, -1):
        return True
    if d.op == "call_function" and d.target is operator.getitem and d.args[1] == -1:
        s = d.args[0]
        is_shape = s.op == "call_function" and s.target is builtins.getattr and s.args == (x, "shape")
        return is_shape or (s.op == "call_method" and s.target == "size" and s.args == (x,))
    return False


def _norm_match(gm, op, anchor, x, nodes, out_node, roles, eps, what, n_features=None) -> Match:
    def make(residual):
        def fused(original, idx):
            return fx_fused.FusedNorm(original, idx, op=op, eps=eps, n=n_features)

        return fused

    label = op
    plain = Match(
        kind="norm",
        label=label,
        anchor=anchor,
        nodes=set(nodes),
        outputs=[out_node],
        roles={"x": x, **roles},
        make_fused=make(False),
        original=what,
        replacement=f"fuseformer {op}",
        scope=_scope(anchor),
        checks=[_check_norm],
    )
    add = x
    if _op(gm, add) == "add" and len(add.args) == 2 and all(isinstance(a, fx.Node) for a in add.args):
        if any(u not in nodes for u in add.users):  # the sum is the residual stream: used again
            return Match(
                kind="norm",
                label=label,
                anchor=anchor,
                nodes=set(nodes) | {add},
                outputs=[out_node, add],
                roles={"x": add.args[1], "residual": add.args[0], **roles},
                make_fused=make(True),
                original=f"add -> {what}",
                replacement=f"fuseformer {op} (+ residual add)",
                scope=_scope(anchor),
                checks=[_check_norm],
                fallback=plain,
            )
    return plain


def _check_norm(m: Match, has_meta: bool, training: bool) -> str | None:
    if not has_meta:
        return None
    x, res = m.roles["x"], m.roles.get("residual")
    if not _is_float_meta(x):
        return "its input is not a float tensor"
    if res is not None:
        if _meta(res) is None or _meta(res).shape != _meta(x).shape or _meta(res).dtype != _meta(x).dtype:
            return "the residual add broadcasts or mixes dtypes"
    return None


# --------------------------------------------------------------------------------------------
# Gated MLPs
# --------------------------------------------------------------------------------------------
def _activation(gm: fx.GraphModule, n: Any) -> tuple[fx.Node, str, str, set] | None:
    """(gate, "silu"|"gelu", approximate, nodes) when n computes act(gate)."""
    o = _op(gm, n)
    mod = _module(gm, n) if isinstance(n, fx.Node) else None
    if o == "silu" and not (_arg(n, 1, "inplace", False) or getattr(mod, "inplace", False)):
        return n.args[0], "silu", "", {n}
    if o == "gelu":
        approx = mod.approximate if mod is not None else _arg(n, 1, "approximate", "none")
        return n.args[0], "gelu", approx, {n}
    if o == "mul" and len(n.args) == 2:
        for a, s in (n.args, n.args[::-1]):
            if _op(gm, s) == "sigmoid" and s.args[:1] == (a,) and len(s.users) == 1 and isinstance(a, fx.Node):
                return a, "silu", "", {n, s}
    return None


def match_glu(gm: fx.GraphModule, training: bool) -> list[Match]:
    """silu(gate) * up (F.silu, nn.SiLU, gate * sigmoid(gate)) and gelu(gate) * up (exact or tanh)."""
    out = []
    for m in gm.graph.nodes:
        if _op(gm, m) != "mul" or len(m.args) != 2 or not all(isinstance(a, fx.Node) for a in m.args):
            continue
        for act_node, up in (m.args, m.args[::-1]):
            act = _activation(gm, act_node)
            if act is None or len(act_node.users) != 1:
                continue
            gate, name, approx, nodes = act
            if up is gate or up in nodes:
                continue
            op = "swiglu" if name == "silu" else "geglu"
            what = "silu(gate) * up" if name == "silu" else f"gelu(gate, {approx}) * up"

            def fused(original, idx, op=op, approx=approx):
                return fx_fused.FusedGLU(original, idx, op=op, approximate=approx)

            out.append(
                Match(
                    kind="mlp",
                    label=op,
                    anchor=m,
                    nodes=nodes | {m},
                    outputs=[m],
                    roles={"gate": gate, "up": up},
                    make_fused=fused,
                    original=what,
                    replacement=f"fuseformer {op}",
                    note=f"{op} between the existing linears",
                    scope=_scope(m),
                    checks=[_check_glu],
                )
            )
            break
    return out


def _check_glu(m: Match, has_meta: bool, training: bool) -> str | None:
    if not has_meta:
        return None
    g, u = m.roles["gate"], m.roles["up"]
    if not _is_float_meta(g, u) or _meta(g).shape != _meta(u).shape or _meta(g).dtype != _meta(u).dtype:
        return "gate and up differ in shape or dtype (a broadcast product, not a GLU)"
    return None


# --------------------------------------------------------------------------------------------
# Linear + cross-entropy
# --------------------------------------------------------------------------------------------
def match_linear_ce(gm: fx.GraphModule, training: bool) -> list[Match]:
    """cross_entropy(linear(h).view(-1, V), target) (F.cross_entropy or nn.CrossEntropyLoss)."""
    out = []
    for ce in gm.graph.nodes:
        if _op(gm, ce) != "cross_entropy":
            continue
        mod = _module(gm, ce)
        if mod is not None:
            cfg = (mod.weight, mod.ignore_index, mod.reduction, mod.label_smoothing, None, None)
        else:
            cfg = (
                _arg(ce, 2, "weight"),
                _arg(ce, 4, "ignore_index", -100),
                _arg(ce, 6, "reduction", "mean"),
                _arg(ce, 7, "label_smoothing", 0.0),
                _arg(ce, 3, "size_average"),
                _arg(ce, 5, "reduce"),
            )
        class_weight, ignore_index, reduction, smoothing, size_average, reduce = cfg
        nodes, cur = {ce}, ce.args[0]
        while _op(gm, cur) in ("view", "reshape", "flatten") and len(cur.users) == 1:
            nodes.add(cur)
            cur = cur.args[0]
        if _op(gm, cur) != "linear" or len(ce.args) < 2:
            continue
        lin = cur
        lmod = _module(gm, lin)
        if lmod is not None:
            w = ("attr", f"{lin.target}.weight")
            b = ("attr", f"{lin.target}.bias") if lmod.bias is not None else None
        else:
            w, b = lin.args[1], _arg(lin, 2, "bias")
            if not (isinstance(w, fx.Node) and w.op == "get_attr") or not (
                b is None or (isinstance(b, fx.Node) and b.op == "get_attr")
            ):
                continue
        nodes.add(lin)
        reasons = []
        if not training:
            reasons.append("fused only when training (then the loss needs no full logits)")
        if class_weight is not None or size_average is not None or reduce is not None:
            reasons.append("class weights or the legacy size_average/reduce arguments")
        if not (isinstance(ignore_index, int) and reduction in ("mean", "sum", "none") and _number(smoothing)):
            reasons.append("non-constant ignore_index, reduction or label_smoothing")
        if len(lin.users) != 1:
            reasons.append("the logits are also used elsewhere, so they must exist anyway")

        def fused(original, idx, cfg=(ignore_index, reduction, smoothing)):
            return fx_fused.FusedLinearCrossEntropy(
                original, idx, ignore_index=cfg[0], reduction=cfg[1], label_smoothing=cfg[2]
            )

        logits_in = ce.args[0]

        def check(m, has_meta, training, reasons=reasons, logits_in=logits_in, lin=lin):
            if reasons:
                return reasons[0]
            if has_meta:
                s, ls = _meta(logits_in), _meta(lin)
                if s is None or ls is None or len(s.shape) != 2 or s.shape[1] != ls.shape[-1]:
                    return "cross_entropy's input is not the logits flattened to (tokens, vocab)"
            elif logits_in is not lin and not (_op(gm, logits_in) in ("view", "reshape") and logits_in.args[1] == -1):
                return "cannot tell without sample inputs that the logits are flattened to (tokens, vocab)"
            return None

        out.append(
            Match(
                kind="loss",
                label="linear_cross_entropy",
                anchor=ce,
                nodes=nodes,
                outputs=[ce],
                roles={"h": lin.args[0], "w": w, "b": b, "target": ce.args[1]},
                make_fused=fused,
                original="linear -> cross_entropy",
                replacement="fuseformer fused_linear_cross_entropy",
                note="the full logits are never formed",
                scope=_scope(lin),
                checks=[check],
            )
        )
    return out
