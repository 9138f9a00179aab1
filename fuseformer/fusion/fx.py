"""The fusion pass for any ``nn.Module``: trace with torch.fx, find the patterns our ops fuse.

``find_candidates`` traces the model with ``torch.fx`` (``symbolic_trace``'s tracer, buffers as
``get_attr``); where the whole model does not trace (data-dependent control flow, say), it traces
its children instead, recursively, and reports what it could not trace. In each traced graph it
looks for (see ``fusion/fx_patterns.py``):

- RMSNorm written out (``x * rsqrt(mean(x^2, -1, keepdim) + eps) * w`` and its variants),
  ``F.rms_norm`` / ``nn.RMSNorm``, ``F.layer_norm`` / ``nn.LayerNorm``, each with the residual add
  before it fused when the add's result is used again ("norm");
- ``matmul -> scale -> (causal mask) -> softmax -> (dropout) -> matmul`` and
  ``F.scaled_dot_product_attention`` ("attention");
- ``silu(gate) * up`` and ``gelu(gate) * up`` ("mlp");
- ``linear -> (view) -> cross_entropy`` when training ("loss").

How a match is replaced, without moving a parameter (state-dict names stay as they were):

1. The matched nodes move into a small parameter-free submodule (a ``GraphModule`` that computes
   exactly the original subgraph), registered under ``<scope>._fuseformer_fx.<name>``; weights
   flow into it as inputs from ``get_attr`` nodes of the outer graph.
2. The traced module keeps its identity (same object, class, attributes and parameters): only its
   ``forward`` becomes, on that instance, the generated code of the rewritten graph, behind a guard
   that runs the class's own ``forward`` whenever a call leaves what the trace assumed (another
   train/eval mode, a non-tensor argument with another value). ``PassResult.restore`` removes the
   instance ``forward`` and the container.
3. Each candidate's ``apply``/``undo`` swaps the submodule at that name between the original
   subgraph and its fused twin (``fusion/fx_fused.py``), which calls the op and falls back to the
   original subgraph for inputs the op does not take (a head dim above the limit, mismatched dtypes).
"""

from __future__ import annotations

import inspect
import operator
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from fuseformer.fusion.base import Candidate, PassResult, Skipped
from fuseformer.fusion.fx_attention import match_attention
from fuseformer.fusion.fx_patterns import Match, match_glu, match_linear_ce, match_norm_ops, match_rms_hand, validate

# The attribute (a parameter-free nn.Module) under which a traced module holds its fused slots.
CONTAINER = "_fuseformer_fx"
_SIMPLE = (type(None), bool, int, float, str)
# (kind, matcher), in the order they claim nodes: norms first, so that an add -> norm is taken
# whole; the rest do not overlap.
MATCHERS: tuple[tuple[str, Callable[[fx.GraphModule, bool], list[Match]]], ...] = (
    ("norm", match_rms_hand),
    ("norm", match_norm_ops),
    ("mlp", match_glu),
    ("attention", match_attention),
    ("loss", match_linear_ce),
)


def find_candidates(
    model: nn.Module,
    *,
    training: bool,
    kinds: frozenset[str],
    sample_args: tuple = (),
    sample_kwargs: dict | None = None,
) -> PassResult:
    """Trace ``model`` (or, where it does not trace, its children) and return the fusions it allows.

    Args:
        model: any nn.Module; it is restructured (see the module docstring) only where a pattern
            was found, and ``restore`` of the result undoes that.
        training: whether the model is optimized for training (enables the loss fusion; attention
            with active dropout is skipped).
        kinds: the kinds to look for, from ``fusion.base.KINDS``.
        sample_args, sample_kwargs: a call of ``model`` that runs; used for the shapes and dtypes
            every check needs, to read masks, and to prove each trace reproduces its module. Without
            them the pass matches on structure alone (and skips masked attention).

    Returns:
        PassResult("fx") with one candidate per match, the skipped matches and untraceable modules
        with their reasons, and ``restore``.
    """
    result = PassResult(name="fx")
    if not kinds:
        return result
    calls = _Calls(model, sample_args, sample_kwargs or {}) if (sample_args or sample_kwargs) else None
    restores: list[Callable[[], None]] = []
    _visit(model, "", training, kinds, calls, result, restores)
    if restores:

        def restore() -> None:
            for r in reversed(restores):
                r()

        result.restore = restore
    return result


# --------------------------------------------------------------------------------------------
# Sample calls of every module, so that a traced child gets its own inputs
# --------------------------------------------------------------------------------------------
class _Calls:
    """The first call (args, kwargs, output, RNG state) of each module in one run of the sample."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        self.model, self.args, self.kwargs = model, args, kwargs
        self.seen: dict[int, tuple] | None = None

    def get(self, module: nn.Module) -> tuple | None:
        if self.seen is None:
            self.seen = {}
            handles = []
            for m in self.model.modules():
                handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                handles.append(m.register_forward_hook(self._post))
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices()):
                    torch.manual_seed(0)
                    self.model(*self.args, **self.kwargs)
            except Exception:  # noqa: BLE001 (the core has run the sample already; stay quiet)
                pass
            finally:
                for h in handles:
                    h.remove()
        return self.seen.get(id(module))

    def _pre(self, module, args, kwargs):
        if id(module) not in self.seen:
            self.seen[id(module)] = (args, kwargs, None, _rng_state())

    def _post(self, module, args, output):
        rec = self.seen.get(id(module))
        if rec is not None and rec[2] is None:
            self.seen[id(module)] = (rec[0], rec[1], output, rec[3])


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


def _rng_state() -> tuple:
    cuda = [torch.cuda.get_rng_state(d) for d in _cuda_devices()]
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    torch.random.set_rng_state(state[0])
    for d, s in zip(_cuda_devices(), state[1], strict=False):
        torch.cuda.set_rng_state(s, d)


# --------------------------------------------------------------------------------------------
# Tracing, the whole model first, then children where it fails
# --------------------------------------------------------------------------------------------
class _Tracer(fx.Tracer):
    # Buffers (causal masks) as get_attr nodes, not constants frozen at the traced length.
    proxy_buffer_attributes = True


_TRACE_LEAVES = (nn.RMSNorm, nn.LayerNorm)  # torch.nn leaves worth tracing on their own


def _visit(
    module: nn.Module,
    path: str,
    training: bool,
    kinds: frozenset[str],
    calls: _Calls | None,
    result: PassResult,
    restores: list,
) -> None:
    if CONTAINER in module._modules:
        return  # restructured by an earlier pass over this model
    is_container = type(module).forward is nn.Module.forward or isinstance(module, (nn.ModuleList, nn.ModuleDict))
    is_leaf = _Tracer().is_leaf_module(module, path) and not isinstance(module, _TRACE_LEAVES)
    if is_container or (is_leaf and not isinstance(module, nn.Sequential)):
        for name, child in module.named_children():
            _visit(child, _join(path, name), training, kinds, calls, result, restores)
        return
    reason = _trace_scope(module, path, training, kinds, calls, result, restores)
    if reason is None:
        return
    result.skipped.append(Skipped(path=path, kind="trace", reason=reason))
    for name, child in module.named_children():
        _visit(child, _join(path, name), training, kinds, calls, result, restores)


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def _trace_scope(
    module: nn.Module,
    path: str,
    training: bool,
    kinds: frozenset[str],
    calls: _Calls | None,
    result: PassResult,
    restores: list,
) -> str | None:
    """Trace one module, match, and restructure it if anything matched. Returns why it could not
    be traced (its children are then tried), or None."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError) as e:
        return f"no signature for forward: {e}"
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        return "forward takes *args/**kwargs, which torch.fx cannot trace by name"
    call = calls.get(module) if calls is not None else None
    if call is not None:
        try:
            bound = sig.bind(*call[0], **call[1])
        except TypeError as e:
            return f"its sample call does not bind to forward: {e}"
        bound.apply_defaults()
        values = dict(bound.arguments)
    else:  # no sample: specialize on the defaults (None-valued flags, mostly)
        values = {n: p.default for n, p in sig.parameters.items() if p.default is not p.empty}
    specialized = {n: v for n, v in values.items() if isinstance(v, _SIMPLE)}
    tensors = {n for n, v in values.items() if isinstance(v, torch.Tensor)}
    before = set(module.__dict__)
    try:
        # Traced in both modes: where the code reads ``self.training`` the graphs differ, and the
        # eval graph is used in eval mode only (training runs the class's forward). Otherwise the
        # one graph serves both modes.
        graphs = {}
        for mode in (False, True, False):
            _drop_new_attrs(module, before)  # tensor constants of the trace before
            with _mode(module, mode):
                graphs[mode] = _Tracer().trace(module, concrete_args=dict(specialized) or None)
            if mode and graphs[False].python_code("self").src == graphs[True].python_code("self").src:
                break
    except Exception as e:  # noqa: BLE001 (anything fx raises means: not traceable)
        _drop_new_attrs(module, before)
        return f"not traceable by torch.fx ({type(e).__name__}: {_first_line(e)}); its children were tried instead"
    same = graphs[False].python_code("self").src == graphs[True].python_code("self").src
    traced_mode = None if same else False
    graph = graphs[True] if same else graphs[False]  # the last traced: its constants are on the module
    gm = fx.GraphModule(module, graph)

    found: list[Match] = []
    for kind, matcher in MATCHERS:
        if kind in kinds:
            found.extend(matcher(gm, training))
    if not found:
        _drop_new_attrs(module, before)
        return None

    meta_ok = False
    if call is not None:
        keep = set().union(*(m.keep for m in found))
        rec = _Record(gm, keep)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices()):
                _set_rng_state(call[3])
                out = rec.propagate(*[values[n] for n in sig.parameters])
        except Exception as e:  # noqa: BLE001
            _drop_new_attrs(module, before)
            return f"its traced graph does not run on the sample ({type(e).__name__}: {_first_line(e)})"
        if call[2] is not None and (same or not module.training) and not _same_output(out, call[2]):
            _drop_new_attrs(module, before)
            return "its traced graph does not reproduce the module's output on the sample"
        meta_ok = True
        for m in found:
            m.values = {n: rec.values[n] for n in m.keep if n in rec.values}

    order = {n: i for i, n in enumerate(graph.nodes)}
    chosen: list[Match] = []
    claimed: set[fx.Node] = set()
    for m in sorted(found, key=lambda m: order[m.anchor]):
        while m is not None:
            reason = validate(m, order, meta_ok, training)
            if reason is None and m.nodes & claimed:
                reason = "overlaps another match"
            if reason is None:
                break
            if m.fallback is None:
                if reason != "overlaps another match":
                    result.skipped.append(Skipped(path=_join(path, m.scope or m.label), kind=m.kind, reason=reason))
                m = None
            else:
                m = m.fallback
        if m is not None:
            claimed |= m.nodes
            chosen.append(m)
    if not chosen:
        _drop_new_attrs(module, before)
        return None

    container = nn.Module()
    names: dict[str, int] = {}
    for m in chosen:
        base = f"{m.scope.replace('.', '_')}_{m.label}" if m.scope else m.label
        names[base] = names.get(base, -1) + 1
        m.name = base if names[base] == 0 else f"{base}_{names[base]}"
        m.inputs = _inputs(m, order)
        m.original_module = _original_module(gm, m, order)
        container.add_module(m.name, m.original_module)
    gm.add_module(CONTAINER, container)  # graph.call_module checks its owning module has the target
    moved: dict[fx.Node, fx.Node] = {}  # an earlier match's output -> what now computes it
    for m in chosen:
        _rewrite(graph, m, order, moved)
    graph.lint()
    module.add_module(CONTAINER, container)
    fx_forward = type(fx.GraphModule(module, graph)).forward
    module.forward = types.MethodType(_guarded(fx_forward, sig, specialized, tensors, traced_mode), module)

    def restore() -> None:
        module.__dict__.pop("forward", None)
        module._modules.pop(CONTAINER, None)
        _drop_new_attrs(module, before)

    restores.append(restore)
    for m in chosen:
        result.candidates.append(_candidate(path, container, m))
    return None


def _candidate(scope: str, container: nn.Module, m: Match) -> Candidate:
    fused = m.make_fused(m.original_module, {role: _index(m.inputs, v) for role, v in m.roles.items()})

    def apply() -> None:
        setattr(container, m.name, fused)

    def undo() -> None:
        setattr(container, m.name, m.original_module)

    weights = [_owner(v.target if isinstance(v, fx.Node) else v[1]) for v in m.roles.values() if _is_weight(v)]
    params = _common_prefix(weights) if weights else m.scope
    return Candidate(
        path=_join(scope, f"{CONTAINER}.{m.name}"),
        kind=m.kind,
        original=m.original,
        replacement=m.replacement,
        apply=apply,
        undo=undo,
        params=_join(scope, params) if params else (scope or ""),
        note=m.note,
    )


def _is_weight(v: Any) -> bool:
    return (isinstance(v, fx.Node) and v.op == "get_attr") or (isinstance(v, tuple) and v[:1] == ("attr",))


def _owner(target: str) -> str:
    return target.rpartition(".")[0]


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _index(inputs: list, v: Any) -> int | None:
    if v is None:
        return None
    key = v[1] if isinstance(v, tuple) else v
    return inputs.index(key)


def _guarded(fx_forward, sig: inspect.Signature, specialized: dict, tensors: set, traced_training: bool | None):
    """The instance forward: the rewritten graph while a call is one the trace covers, else the
    class's own forward (so a call with another mode or flag computes what it always did)."""
    names = list(sig.parameters)

    def forward(self, *args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if (
            (traced_training is not None and self.training != traced_training)
            or any(not (type(a[n]) is type(v) and a[n] == v) for n, v in specialized.items())
            or any(not isinstance(a[n], torch.Tensor) for n in tensors)
        ):
            return type(self).forward(self, *args, **kwargs)
        return fx_forward(self, *[a[n] for n in names])

    return forward


class _mode:
    """Every module under ``module`` in train (True) or eval mode for the block, then as it was."""

    def __init__(self, module: nn.Module, training: bool) -> None:
        self.module, self.training = module, training

    def __enter__(self) -> None:
        self.saved = [(m, m.training) for m in self.module.modules()]
        self.module.train(self.training)

    def __exit__(self, *exc) -> None:
        for m, t in self.saved:
            m.training = t


def _drop_new_attrs(module: nn.Module, before: set) -> None:
    # symbolic_trace stores tensor constants (``_tensor_constant0``) on the traced module.
    for name in set(module.__dict__) - before:
        if name != "forward":
            del module.__dict__[name]
    for store in (module._buffers, module._parameters):
        for name in [n for n in store if n.startswith("_tensor_constant")]:
            del store[name]


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _same_output(a: Any, b: Any) -> bool:
    fa, _ = torch.utils._pytree.tree_flatten(a)
    fb, _ = torch.utils._pytree.tree_flatten(b)
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and not (x.shape == y.shape and torch.equal(x.nan_to_num(), y.nan_to_num())):
            return False
    return True


class _Record(ShapeProp):
    """ShapeProp (tensor_meta on every node) that also keeps the values of a few nodes (masks)."""

    def __init__(self, gm: fx.GraphModule, keep: set) -> None:
        super().__init__(gm)
        self.keep, self.values = keep, {}

    def run_node(self, n: fx.Node) -> Any:
        r = super().run_node(n)
        if n in self.keep:
            self.values[n] = r
        return r


# --------------------------------------------------------------------------------------------
# Moving a match into its own submodule
# --------------------------------------------------------------------------------------------
def _inputs(m: Match, order: dict) -> list:
    """The match's inputs: outer nodes its nodes read (in graph order), then the parameters of
    the torch.nn modules it calls (as attribute targets, read by new get_attr nodes)."""
    nodes: list = []
    for n in sorted(m.nodes, key=order.get):
        for a in n.all_input_nodes:
            if a not in m.nodes and a not in nodes:
                nodes.append(a)
    attrs = [v[1] for v in m.roles.values() if isinstance(v, tuple) and v[:1] == ("attr",)]
    return nodes + [t for t in attrs if t not in nodes]


def _original_module(gm: fx.GraphModule, m: Match, order: dict) -> fx.GraphModule:
    """A parameter-free GraphModule computing exactly the matched subgraph."""
    g = fx.Graph()
    holder = nn.Module()
    env: dict = {}
    for inp in m.inputs:
        name = inp.name if isinstance(inp, fx.Node) else inp.replace(".", "_")
        env[inp] = g.placeholder(name)
    modules = dict(gm.named_modules())
    for n in sorted(m.nodes, key=order.get):
        if n.op == "call_module":
            mod = modules[n.target]
            if any(True for _ in mod.parameters(recurse=False)):
                env[n] = g.call_function(*_functional(mod, n, env))
                continue
            key = f"m{len(holder._modules)}"
            holder.add_module(key, mod)
            env[n] = g.call_module(key, fx.map_arg(n.args, env.__getitem__), fx.map_arg(n.kwargs, env.__getitem__))
        else:
            env[n] = g.node_copy(n, env.__getitem__)
    outs = [env[o] for o in m.outputs]
    g.output(outs[0] if len(outs) == 1 else tuple(outs))
    return fx.GraphModule(holder, g, class_name=f"Fx{m.label.title().replace('_', '')}")


def _functional(mod: nn.Module, n: fx.Node, env: dict) -> tuple:
    """(function, args) computing ``mod(x)`` from its parameters passed in as inputs."""
    x = env[n.args[0]]
    t = n.target
    w = env[f"{t}.weight"]
    b = env.get(f"{t}.bias")
    if isinstance(mod, nn.Linear):
        return torch.nn.functional.linear, (x, w, b)
    if isinstance(mod, nn.LayerNorm):
        return torch.nn.functional.layer_norm, (x, mod.normalized_shape, w, b, mod.eps)
    if isinstance(mod, nn.RMSNorm):
        return torch.nn.functional.rms_norm, (x, mod.normalized_shape, w, mod.eps)
    raise TypeError(f"fx pass: no functional form for {type(mod).__name__}")  # matchers never ask


def _rewrite(graph: fx.Graph, m: Match, order: dict, moved: dict) -> None:
    last = max(m.nodes, key=order.get)
    with graph.inserting_before(last):
        args = [graph.get_attr(t) if isinstance(t, str) else moved.get(t, t) for t in m.inputs]
        call = graph.call_module(f"{CONTAINER}.{m.name}", tuple(args))
        if len(m.outputs) == 1:
            outs = [call]
        else:
            outs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(m.outputs))]
    for o, new in zip(m.outputs, outs, strict=True):
        o.replace_all_uses_with(new, delete_user_cb=lambda u: u not in m.nodes)
        moved[o] = new
    for n in sorted(m.nodes, key=order.get, reverse=True):
        graph.erase_node(n)
