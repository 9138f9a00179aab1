"""Trainer: convergence (fused vs reference), accumulation, activation checkpointing, packed rows,
mixed precision, metrics, and the ``fuseformer train`` entry."""

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuseformer
from fuseformer.models.llama import AttentionMetadata
from fuseformer.runtime.backend import choose_backend
from fuseformer.train import TrainConfig, Trainer
from fuseformer.train.cli import main as train_main
from fuseformer.train.data import IGNORE_INDEX
from fuseformer.train.trainer import lr_at


def _config(model, tmp_path, **kw):
    args = dict(
        model=model,
        seq_len=16,
        micro_batch_size=1,
        grad_accum_steps=1,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=3,
        max_steps=30,
        precision="fp32",
        out_dir=str(tmp_path),
        progress=False,
        log_every=0,
        resume=False,
    )
    return TrainConfig(**(args | kw))


def _grads(trainer):
    return {n: p.grad.clone() for n, p in trainer.lm.named_parameters()}


@pytest.mark.slow
def test_convergence_fused_matches_reference(tmp_path, model_config, corpus):
    """30 steps, fp32: the fused path (Triton interpreter: rms_norm, rotary, swiglu, fused linear
    CE; attention falls back to its reference in fp32) and the reference path give the same losses
    at every step, and the loss goes down."""
    model = model_config(num_hidden_layers=1)
    losses = {}
    for backend in ("auto", "reference"):
        cfg = _config(model, tmp_path / backend)
        with fuseformer.use_backend(backend):
            assert choose_backend("rms_norm", torch.device("cpu")) == ("triton" if backend == "auto" else "reference")
            losses[backend] = Trainer(cfg, train_corpus=corpus()).train().losses
    fused, ref = np.array(losses["auto"]), np.array(losses["reference"])
    assert len(fused) == len(ref) == 30
    np.testing.assert_allclose(fused, ref, rtol=2e-4, atol=2e-4)
    assert fused[0] > math.log(32) - 0.3  # starts near uniform over the vocab
    assert fused[-5:].mean() < fused[:5].mean() - 0.5


@pytest.mark.parametrize("split", [(1, 4), (2, 2)])
def test_accumulation_matches_one_batch(tmp_path, model_config, corpus, split):
    """N micro-batches with accumulation give the gradients (and loss) of one N-times batch."""
    micro, accum = split
    results = []
    with fuseformer.use_backend("reference"):
        for b, a in ((4, 1), (micro, accum)):
            cfg = _config(model_config(), tmp_path, micro_batch_size=b, grad_accum_steps=a)
            t = Trainer(cfg, train_corpus=corpus())
            loss, targets = t.forward_backward(t.sampler.next_step())
            results.append((loss, targets, _grads(t)))
    (l1, n1, g1), (l2, n2, g2) = results
    assert n1 == n2 and n1 > 0
    assert l1 == pytest.approx(l2, rel=1e-6)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", ["all", "every:2", "all-but:1", "all-but:0"])
def test_activation_checkpointing(tmp_path, model_config, corpus, mode):
    """Same gradients with checkpointing; the checkpointed layers' MLPs run again in backward."""
    model = model_config(num_hidden_layers=3)
    out = {}
    with fuseformer.use_backend("reference"):
        for m in ("off", mode):
            t = Trainer(_config(model, tmp_path, activation_checkpointing=m), train_corpus=corpus())
            calls = [0] * 3
            for i, layer in enumerate(t.lm.model.layers):
                layer.mlp.register_forward_pre_hook(lambda *_, i=i, c=calls: c.__setitem__(i, c[i] + 1))
            t.forward_backward(t.sampler.next_step())
            out[m] = (_grads(t), calls)
    assert out["off"][1] == [1, 1, 1]
    expected = {"all": [2, 2, 2], "every:2": [2, 1, 2], "all-but:1": [2, 2, 1], "all-but:0": [2, 2, 2]}
    assert out[mode][1] == expected[mode]
    for name, g in out["off"][0].items():
        torch.testing.assert_close(out[mode][0][name], g, rtol=1e-6, atol=1e-8, msg=name)


def _token_losses(lm, docs, dtype):
    """Per-token losses of ``docs`` packed into one varlen row (targets within each document)."""
    ids = torch.cat([torch.tensor(d) for d in docs])
    pos = torch.cat([torch.arange(len(d)) for d in docs])
    targets = torch.cat([torch.tensor([*d[1:], IGNORE_INDEX]) for d in docs])
    meta = AttentionMetadata.varlen([len(d) for d in docs])
    with torch.no_grad():
        logits = lm.compute_logits(lm(ids, pos, meta)).float()
    return TF.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_token_loss_independent_of_other_documents(tmp_path, model_config, corpus, dtype):
    """A token's loss does not depend on the other documents in its row (fp16 takes the Triton
    varlen flash-attention kernel under the interpreter; fp32 its reference)."""
    t = Trainer(_config(model_config(), tmp_path), train_corpus=corpus())
    lm = t.lm.to(dtype).eval()
    gen = torch.Generator().manual_seed(0)
    a, b, c, d = (torch.randint(0, 31, (n,), generator=gen).tolist() for n in (5, 7, 6, 7))
    packed = _token_losses(lm, [a, b, c], dtype)
    swapped = _token_losses(lm, [a, d, c], dtype)
    alone_c = _token_losses(lm, [c], dtype)
    alone_a = _token_losses(lm, [a], dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(packed[12:], alone_c, **tol)
    torch.testing.assert_close(swapped[12:], alone_c, **tol)
    torch.testing.assert_close(packed[:5], alone_a, **tol)
    assert not torch.allclose(packed[5:12], swapped[5:12])  # the swapped document's own losses differ


def test_bf16_autocast_fp32_master(tmp_path, model_config, corpus):
    """bf16 autocast trains with fp32 weights and gradients; its first loss is near fp32's."""
    losses = {}
    with fuseformer.use_backend("reference"):
        for precision in ("fp32", "bf16"):
            t = Trainer(_config(model_config(), tmp_path, precision=precision, max_steps=3), train_corpus=corpus())
            losses[precision] = t.train().losses
            assert all(p.dtype == torch.float32 for p in t.lm.parameters())
            assert all(s["exp_avg"].dtype == torch.float32 for s in t.optimizer.state.values())
    assert all(math.isfinite(x) for x in losses["bf16"])
    assert losses["bf16"][0] == pytest.approx(losses["fp32"][0], rel=2e-2)


def test_fp16_overflow_skips_are_counted(tmp_path, model_config, corpus):
    """fp16 with GradScaler: an overflowing scale skips the step (weights unchanged), is counted and
    logged in metrics.jsonl; the scale then comes down."""
    with fuseformer.use_backend("reference"):
        t = Trainer(_config(model_config(), tmp_path, precision="fp16", max_steps=3), train_corpus=corpus())
        t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
        before = {n: p.detach().clone() for n, p in t.lm.named_parameters()}
        result = t.train()
    assert result.skipped_steps == 3 == t.skipped_steps
    assert t.scaler.get_scale() == 2.0**117
    for n, p in t.lm.named_parameters():
        assert torch.equal(p, before[n]), n
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["skipped_steps"] for x in lines] == [1, 2, 3]


def test_metrics_eval_and_curve(tmp_path, model_config, corpus):
    full = corpus(80)
    train_c, eval_c = full.split(0.25, seed=0)
    cfg = _config(model_config(), tmp_path, max_steps=4, eval_every=2, eval_batches=2, micro_batch_size=2)
    with fuseformer.use_backend("reference"):
        t = Trainer(cfg, train_corpus=train_c, eval_corpus=eval_c)
        result = t.train()
        direct = t.evaluate()
    assert sorted(result.eval_losses) == [2, 4]
    assert result.eval_losses[4] == pytest.approx(direct, rel=1e-6)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps"} <= set(lines[0])
    assert [("eval_loss" in x) for x in lines] == [False, True, False, True]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule():
    cfg = TrainConfig(model="unused", lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, cfg) == pytest.approx(0.55)
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)


def test_cli_end_to_end(tmp_path, tokenizer_dir, model_config, capsys):
    """fuseformer train with a .toml config and flags on a folder of text files: metrics, a curve,
    a checkpoint, an exported bf16 model; a folder without data is a clear error (exit 2)."""
    from fuseformer.models.loader import load_model

    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 3)
    (data / "latin1.py").write_bytes(b"s = '\xe9t\xe9'\n")
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'seq_len = 16\nmicro_batch_size = 2\nlr = 0.005\nprecision = "fp32"\n'
        f'[model]\narchitecture = "LlamaForCausalLM"\nvocab_size = {len(vocab)}\nhidden_size = 32\n'
        "intermediate_size = 48\nnum_hidden_layers = 1\nnum_attention_heads = 2\nnum_key_value_heads = 1\n"
    )
    out = tmp_path / "run"
    argv = ["--config", str(toml), "--data", str(data), "--tokenizer", str(tokenizer_dir), "--out-dir", str(out)]
    argv += ["--max-steps", "3", "--save-every", "3", "--eval-split", "0.2", "--eval-every", "3", "--progress", "false"]
    with fuseformer.use_backend("reference"), pytest.warns(UserWarning, match="not UTF-8"):
        assert train_main([*argv, "--export", str(tmp_path / "export")]) == 0
    printed = capsys.readouterr().out
    assert "step 3" in printed and "eval loss" in printed
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert (out / "loss.png").is_file() and (out / "checkpoints" / "step_0000003" / "config.json").is_file()
    lm, cfg = load_model(tmp_path / "export")
    assert cfg.hidden_size == 32 and next(lm.parameters()).dtype == torch.bfloat16
    assert (tmp_path / "export" / "tokenizer.json").is_file()

    (tmp_path / "empty").mkdir()
    bad = ["--config", str(toml), "--data", str(tmp_path / "empty"), "--tokenizer", str(tokenizer_dir)]
    assert train_main([*bad, "--out-dir", str(tmp_path / "run2")]) == 2
    assert "holds no files" in capsys.readouterr().err
    assert train_main([*argv, "--precision", "fp8"]) == 2
    assert "precision" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_loss_sum_does_not_overflow_low_precision(dtype):
    """20k tokens at loss ~log(32): the sum (~69k) is past fp16's max and coarse in bf16; the
    trainer's loss helper still returns it in fp32 within 0.5% of the fp32 sum."""
    from fuseformer.train.loss import linear_cross_entropy_sum

    hidden = torch.randn(20000, 8) * 0.1
    weight = torch.randn(32, 8)
    target = torch.randint(0, 32, (20000,))
    target[::7] = IGNORE_INDEX
    with fuseformer.use_backend("reference"):
        low = linear_cross_entropy_sum(hidden.to(dtype), weight, target)
    exact = TF.cross_entropy(hidden.double() @ weight.double().T, target, ignore_index=IGNORE_INDEX, reduction="sum")
    assert low.dtype == torch.float32 and math.isfinite(low.item())
    assert low.item() == pytest.approx(exact.item(), rel=5e-3)


@pytest.mark.parametrize("backend, dtype", [("triton", torch.float16), ("reference", torch.float32)])
def test_softcapped_loss_through_the_fused_op(backend, dtype, model_config):
    """Gemma2's final soft-cap (a cap of 0.5 that bites) goes into the fused loss: the sum and every
    gradient against compute_logits + torch's cross-entropy in fp64 (DESIGN.md §3)."""
    from fuseformer.models.registry import build_model
    from fuseformer.testing import assert_close
    from fuseformer.train.trainer import CausalLMLoss

    torch.manual_seed(0)
    config = model_config(architecture="Gemma2ForCausalLM", head_dim=8, sliding_window=4, hidden_act="gelu_tanh",
                        final_logit_softcapping=0.5, attn_logit_softcapping=None)  # fmt: skip
    lm = build_model(config).to(dtype)
    ids = torch.randint(0, config.vocab_size, (12,))
    targets = torch.randint(0, config.vocab_size, (12,))
    targets[::5] = IGNORE_INDEX
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    pos = torch.cat([torch.arange(5), torch.arange(7)])

    def exact(m):
        hidden = m(ids, pos, AttentionMetadata(cu_seqlens_q=cu, max_seqlen_q=7))
        return TF.cross_entropy(m.compute_logits(hidden), targets, ignore_index=IGNORE_INDEX, reduction="sum")

    ref, base = copy.deepcopy(lm).double(), copy.deepcopy(lm)
    with fuseformer.use_backend(backend):
        ours = CausalLMLoss(lm)(ids, pos, cu, 7, targets)
    with fuseformer.use_backend("reference"):
        want, got_base = exact(ref), exact(base)
        uncapped = copy.deepcopy(ref)
        uncapped.config = dataclasses.replace(ref.config, final_logit_softcapping=None)
        assert abs(exact(uncapped) - want) > 0.5  # the cap bites
    assert_close("loss", ours, want, got_base)
    for o in (ours, want, got_base):
        o.backward()
    for (name, p), r, b in zip(lm.named_parameters(), ref.parameters(), base.parameters()):
        assert_close(f"grad {name}", p.grad, r.grad, b.grad)


def _tiny_run_argv(tmp_path, tokenizer_dir, *extra):
    """Flags of a 2-step run from scratch on a folder of Python files (config file with a [model] table)."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for i in range(8):
        (data / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 3)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'seq_len = 16\nmicro_batch_size = 2\nlr = 0.005\n[model]\narchitecture = "LlamaForCausalLM"\n'
        f"vocab_size = {len(vocab)}\nhidden_size = 32\nintermediate_size = 48\nnum_hidden_layers = 1\n"
        "num_attention_heads = 2\nnum_key_value_heads = 1\n"
    )
    argv = ["--config", str(toml), "--data", str(data), "--tokenizer", str(tokenizer_dir)]
    return [*argv, "--out-dir", str(tmp_path / "run"), "--max-steps", "2", "--progress", "false", *extra]


def test_export_without_checkpoints(tmp_path, tokenizer_dir, capsys):
    """--export with the default --save-every 0 exports the final model from memory (it used to
    train to the end and then fail for want of a checkpoint)."""
    from fuseformer.models.loader import load_model

    with fuseformer.use_backend("reference"):
        assert train_main(_tiny_run_argv(tmp_path, tokenizer_dir, "--export", str(tmp_path / "export"))) == 0
    assert "exported" in capsys.readouterr().out
    assert not (tmp_path / "run" / "checkpoints").exists()
    lm, cfg = load_model(tmp_path / "export")
    assert cfg.hidden_size == 32 and next(lm.parameters()).dtype == torch.bfloat16
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    (tmp_path / "file").write_text("x")
    assert train_main(_tiny_run_argv(tmp_path, tokenizer_dir, "--export", str(tmp_path / "file"))) == 2
    assert "is a file" in capsys.readouterr().err


def test_eval_every_zero_never_evaluates(tmp_path, model_config, corpus):
    train_c, eval_c = corpus(80).split(0.25, seed=0)
    with fuseformer.use_backend("reference"):
        never = Trainer(_config(model_config(), tmp_path / "a", max_steps=2), train_corpus=train_c, eval_corpus=eval_c)
        assert never.train().eval_losses == {}
        every = _config(model_config(), tmp_path / "b", max_steps=3, eval_every=2)
        assert sorted(Trainer(every, train_corpus=train_c, eval_corpus=eval_c).train().eval_losses) == [2, 3]
    assert not any("eval_loss" in json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines())


def test_default_precision_is_fp32_on_cpu(tmp_path, model_config, corpus):
    """precision "auto" (the default): bf16 autocast on CUDA, fp32 on a CPU (bf16 ran ~10x slower there)."""
    cfg = TrainConfig(model=model_config(), seq_len=16, micro_batch_size=2, out_dir=str(tmp_path), resume=False)
    assert cfg.precision == "auto"
    t = Trainer(cfg, train_corpus=corpus())
    assert t.precision == "fp32" and t.amp_dtype is None and t.scaler is None


def test_no_matplotlib_no_curve_claimed(tmp_path, tokenizer_dir, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with fuseformer.use_backend("reference"), pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert train_main(_tiny_run_argv(tmp_path, tokenizer_dir)) == 0
    out = capsys.readouterr().out
    assert "no loss curve (matplotlib is not installed)" in out and "loss.png" not in out
    assert not (tmp_path / "run" / "loss.png").exists()


def test_train_model_missing_directory_is_a_clear_error(tmp_path, capsys):
    code = train_main(["--model", str(tmp_path / "nowhere"), "--data", str(tmp_path), "--out-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "nowhere is not a directory" in err and "from scratch" in err and "Traceback" not in err


def test_train_help_is_for_users():
    """Every flag has help and its default; no reST markup or notes meant for developers; the
    description says how to describe a model from scratch."""
    import argparse

    from fuseformer.train.cli import add_train_parser

    parser = add_train_parser(argparse.ArgumentParser().add_subparsers())
    text = parser.format_help()
    assert "``" not in text and "add_train_parser" not in text and "cli.py" not in text
    assert "from scratch" in text and "[model] table" in text and "docs/training.md" in text
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and "(default: " in action.help, action.option_strings
