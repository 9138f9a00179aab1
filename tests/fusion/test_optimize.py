"""The core of ``fuseformer.optimize``: argument checks, verification and revert of over-tolerance
replacements, idempotence, revert. The passes themselves are tested in test_hf*.py and test_fx.py;
here a pass is stood in for by candidates that swap a module for a correct or a wrong twin."""

import pytest
import torch
from torch import nn

import fuseformer
from fuseformer import fusion
from fuseformer.fusion.base import Candidate, PassResult, Skipped


class Block(nn.Module):
    def __init__(self, n=32):
        super().__init__()
        self.fc1 = nn.Linear(n, n)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(n, n)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, n=32):
        super().__init__()
        self.a = Block(n)
        self.b = Block(n)

    def forward(self, x):
        return self.b(self.a(x))


class Scaled(nn.Module):
    """The same computation as ``inner`` times ``factor`` (1 + 1e-7: within tolerance; 1.5: not)."""

    def __init__(self, inner, factor):
        super().__init__()
        self.inner, self.factor = inner, factor

    def forward(self, x):
        return self.inner(x) * self.factor


def _swap(model, path, factor):
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    original = getattr(parent, name)
    twin = Scaled(original, factor)
    return Candidate(
        path=path,
        kind="mlp",
        original=type(original).__name__,
        replacement=f"Scaled({factor})",
        apply=lambda: setattr(parent, name, twin),
        undo=lambda: setattr(parent, name, original),
    )


@pytest.fixture
def stub_pass(monkeypatch):
    """Make optimize's pass return swaps of Net's blocks by the given factors."""
    factors = {}

    def find(model, training, kinds, args, kwargs):
        cands = [_swap(model, p, f) for p, f in factors.items() if "mlp" in kinds]
        return PassResult(name="stub", candidates=cands, skipped=[Skipped(path="a.act", kind="mlp", reason="stub")])

    monkeypatch.setattr(fusion, "_find", find)
    return factors


def test_bad_model_and_kinds():
    with pytest.raises(TypeError, match="model"):
        fuseformer.optimize("not a module")
    with pytest.raises(ValueError, match="include has unknown kind 'norms'"):
        fuseformer.optimize(Net(), include=["norms"])
    with pytest.raises(ValueError, match="exclude"):
        fuseformer.optimize(Net(), exclude=["xyz"])
    with pytest.raises(TypeError, match="sample_inputs"):
        fuseformer.optimize(Net(), sample_inputs=3.0)


def test_wrong_sample_inputs_leave_the_model_untouched(stub_pass):
    stub_pass.update({"a": 1.5})
    net = Net()
    before = list(net.named_modules())
    with pytest.raises(ValueError, match="sample_inputs"):
        fuseformer.optimize(net, sample_inputs=torch.randn(2, 5, 7))
    assert list(net.named_modules()) == before
    assert fusion.revert(net) is False


@pytest.mark.parametrize("training", [False, True])
def test_over_tolerance_reverted_within_kept(stub_pass, training):
    stub_pass.update({"a": 1.0 + 1e-7, "b": 1.5})
    net = Net()
    b = net.b
    x = torch.randn(2, 8, 32)
    report = fuseformer.optimize(net, sample_inputs=x, training=training)
    by_path = {r.path: r for r in report.replacements}
    assert by_path["a"].status == "kept" and by_path["a"].max_error <= by_path["a"].tolerance
    assert by_path["b"].status == "reverted" and by_path["b"].max_error > by_path["b"].tolerance
    if training:
        assert by_path["a"].grad_error is not None and by_path["a"].grad_error <= by_path["a"].grad_tolerance
    assert isinstance(net.a, Scaled) and net.b is b
    assert report.counts() == {"mlp": 1}
    text = str(report)
    assert "reverted" in text and "a.act [mlp]: stub" in text
    d = report.to_dict()
    assert d["counts"] == {"mlp": 1} and len(d["replacements"]) == 2 and d["skipped"][0]["reason"] == "stub"
    # The parameters' .grad are left as they were, and the mode too.
    assert all(p.grad is None for p in net.parameters())


def test_second_optimize_is_a_no_op_and_revert_restores(stub_pass):
    stub_pass.update({"a": 1.0, "b": 1.0})
    net = Net()
    a, b = net.a, net.b
    x = torch.randn(2, 8, 32)
    report = fuseformer.optimize(net, sample_inputs=x)
    assert isinstance(net.a, Scaled) and isinstance(net.b, Scaled)
    assert fuseformer.optimize(net, sample_inputs=x) is report
    assert isinstance(net.a.inner, Block)  # not wrapped twice
    assert fuseformer.revert(net) is True
    assert net.a is a and net.b is b
    assert fuseformer.revert(net) is False
    # After a revert, optimize applies again.
    assert fuseformer.optimize(net, sample_inputs=x).counts() == {"mlp": 2}


def test_include_exclude_reach_the_pass(stub_pass):
    stub_pass.update({"a": 1.0})
    net = Net()
    report = fuseformer.optimize(net, sample_inputs=torch.randn(1, 4, 32), exclude=["mlp", "linear"])
    assert report.replacements == [] and isinstance(net.a, Block)
    assert "nothing to fuse" not in str(report)  # it has a skipped entry
    # Without the stub's "a": Net's four nn.Linear (fp32, CPU) are the "linear" kind's (fusion/linear.py).
    report = fuseformer.optimize(Net(), sample_inputs=torch.randn(1, 4, 32), exclude=["mlp"])
    assert [r.path for r in report.replacements if r.kind == "linear"] == ["a.fc1", "a.fc2", "b.fc1", "b.fc2"]
    assert report.counts() == {"linear": 4}


def test_verify_false_marks_unverified(stub_pass):
    stub_pass.update({"a": 1.5})
    net = Net()
    report = fuseformer.optimize(net, verify=False)
    # The stub's "a", then b's linears, which no stub candidate covers (the "linear" kind, fusion/linear.py).
    assert [(r.path, r.status) for r in report.replacements] == [
        ("a", "unverified"),
        ("b.fc1", "unverified"),
        ("b.fc2", "unverified"),
    ]
    assert isinstance(net.a, Scaled)


def test_built_sample_inputs_from_the_first_layer(stub_pass):
    stub_pass.update({"a": 1.0})
    report = fuseformer.optimize(Net())
    assert report.replacements[0].status == "kept"


def test_scalar_output_judged_at_its_gradients_precision():
    """A loss (one element) of a bf16 model: its baseline error is one draw, small by chance here, so it
    gets the floor of its gradients' dtype (bf16: 8e-3 of the loss); an error past that floor still fails,
    and the gradients keep the 2x check of their own baseline."""
    from fuseformer.fusion.base import Candidate
    from fuseformer.fusion.verify import Run, judge

    c = Candidate(path="", kind="loss", original="o", replacement="r", apply=lambda: None, undo=lambda: None,
                  params="lm_head.weight")  # fmt: skip
    ref_g = torch.randn(64, 32, dtype=torch.float64)
    base_g = (ref_g + 1e-3 * torch.randn_like(ref_g)).bfloat16()

    def runs(loss_err: float, grad_err: float):
        ref = Run({"": torch.tensor(6.93, dtype=torch.float64)}, {"lm_head.weight": ref_g})
        base = Run({"": torch.tensor(6.93 + 3e-4)}, {"lm_head.weight": base_g})
        fused = Run({"": torch.tensor(6.93 + loss_err)}, {"lm_head.weight": (ref_g + grad_err).bfloat16()})
        return fused, base, ref

    assert judge(c, *runs(1.3e-3, 0.0), training=True).passed  # 4x the lucky baseline, far under the floor
    assert not judge(c, *runs(0.2, 0.0), training=True).passed  # 3% off: a wrong loss
    assert not judge(c, *runs(1.3e-3, 0.5), training=True).passed  # gradients judged as before
    fused, base, ref = runs(1.3e-3, 0.0)
    for r in (fused, base, ref):
        r.grads.clear()  # no gradients (an inference run): the output's own dtype, fp32, as before
    v = judge(c, fused, base, ref, training=False)
    assert not v.passed and v.tolerance == pytest.approx(2 * 3e-4 + 1e-5 * 6.93, rel=0.01)
