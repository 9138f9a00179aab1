"""Checkpoints: exact resume, the Hugging Face layout (our loader and transformers read it),
atomic saves, and clear errors for a checkpoint of another model."""

import json

import pytest
import torch

import fuseformer
from fuseformer.models.config import ModelConfig
from fuseformer.models.llama import AttentionMetadata
from fuseformer.train import TrainConfig, Trainer
from fuseformer.train import checkpoint as C


def _config(model, out, **kw):
    args = dict(
        model=model,
        seq_len=16,
        micro_batch_size=2,
        grad_accum_steps=2,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=2,
        max_steps=6,
        precision="fp32",
        activation_checkpointing="every:2",
        out_dir=str(out),
        progress=False,
        log_every=0,
    )
    return TrainConfig(**(args | kw))


def test_resume_matches_uninterrupted(tmp_path, model_config, corpus):
    """Stop after step 4 (checkpoint at 3, so step 4 is lost), resume: steps 4..6 give the losses of
    the run that never stopped, bit for bit (fp32 on CPU), and metrics.jsonl has each step once."""
    model = model_config()
    with fuseformer.use_backend("reference"):
        straight = Trainer(_config(model, tmp_path / "a", resume=False), train_corpus=corpus()).train()

        t = Trainer(_config(model, tmp_path / "b", save_every=3), train_corpus=corpus())
        for _ in range(4):  # killed during step 5, after the checkpoint of step 3
            t.train_step()
            if t.step == 3:
                t.save_checkpoint()
        with (tmp_path / "b" / "metrics.jsonl").open("w") as f:
            f.writelines(json.dumps({"step": s, "loss": 0.0}) + "\n" for s in (1, 2, 3, 4))
        resumed_trainer = Trainer(_config(model, tmp_path / "b", save_every=3), train_corpus=corpus())
        assert resumed_trainer.step == 3 and resumed_trainer.sampler.index > 0
        resumed = resumed_trainer.train()
    assert resumed.losses == straight.losses[3:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    for (name, p), q in zip(
        resumed_trainer.lm.named_parameters(),
        Trainer(_config(model, tmp_path / "b", save_every=3), train_corpus=corpus()).lm.parameters(),
    ):
        assert torch.equal(p, q), name  # the final checkpoint (step 6) reloads to the same weights


def test_hf_layout_loads_in_transformers(tmp_path, model_config, corpus):
    """The checkpoint's model directory has HF names (q/k/v, gate/up unpacked); transformers'
    LlamaForCausalLM loads it and computes our logits."""
    transformers = pytest.importorskip("transformers")
    model = model_config(tie_word_embeddings=False)
    with fuseformer.use_backend("reference"):
        t = Trainer(_config(model, tmp_path, max_steps=1, save_every=1), train_corpus=corpus())
        path = t.train().checkpoint
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    names = set(_safetensors_names(path / "model.safetensors"))
    assert "model.layers.0.self_attn.k_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up" in n for n in names)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 31, (1, 11))
    with torch.no_grad(), fuseformer.use_backend("reference"):
        expected = hf(ids).logits[0]
        lm = t.lm.eval()
        ours = lm.compute_logits(lm(ids[0], torch.arange(11), AttentionMetadata.varlen([11])))
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def _safetensors_names(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


@pytest.mark.parametrize(
    "config",
    [
        dict(architecture="LlamaForCausalLM", num_key_value_heads=2, tie_word_embeddings=True),
        dict(
            architecture="LlamaForCausalLM",
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),  # fmt: skip
        dict(architecture="MistralForCausalLM", sliding_window=8),
        dict(
            architecture="Qwen2ForCausalLM",
            attention_bias=True,
            sliding_window=4,
            layer_types=("full_attention", "sliding_attention"),
        ),  # fmt: skip
        dict(architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=16),
    ],
)
def test_hf_config_round_trip(model_config, config):
    cfg = model_config(**config, torch_dtype=torch.float32)
    assert ModelConfig.from_hf(json.loads(json.dumps(C.hf_config(cfg)))) == cfg


def test_killed_mid_save_keeps_last_good(tmp_path, model_config, corpus, monkeypatch):
    with fuseformer.use_backend("reference"):
        t = Trainer(_config(model_config(), tmp_path, keep_checkpoints=2), train_corpus=corpus())
        t.train_step()
        first = t.save_checkpoint()
        t.train_step()

        def killed(*args, **kwargs):
            raise KeyboardInterrupt("killed mid-save")

        monkeypatch.setattr(C.torch, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            t.save_checkpoint()
        monkeypatch.undo()
        root = C.checkpoint_root(tmp_path)
        assert (root / ".tmp_step_0000002").is_dir()  # the half-written one, under its temporary name
        assert C.latest_checkpoint(tmp_path) == first
        resumed = Trainer(_config(model_config(), tmp_path, keep_checkpoints=2), train_corpus=corpus())
        assert resumed.step == 1
        # later saves clean the leftover and keep the newest keep_checkpoints
        for _ in range(3):
            resumed.train_step()
            resumed.save_checkpoint()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000003", "step_0000004"]
    assert C.latest_checkpoint(tmp_path).name == "step_0000004"


def test_checkpoint_of_another_model_shape(tmp_path, model_config, corpus):
    with fuseformer.use_backend("reference"):
        t = Trainer(_config(model_config(), tmp_path), train_corpus=corpus())
        t.train_step()
        t.save_checkpoint()
        with pytest.raises(ValueError, match=r"another model: hidden_size 32 \(run: 64\)"):
            Trainer(_config(model_config(hidden_size=64), tmp_path), train_corpus=corpus())
        with pytest.raises(ValueError, match="not a trainer checkpoint"):
            t.load_checkpoint(tmp_path)


def test_truncated_newest_state_falls_back_to_older(tmp_path, model_config, corpus):
    """A truncated trainer_state.pt in the newest checkpoint: resume warns and continues from the
    intact older checkpoint beside it; when none reads, the error names the file."""
    with fuseformer.use_backend("reference"):
        t = Trainer(_config(model_config(), tmp_path, keep_checkpoints=2), train_corpus=corpus())
        t.train_step()
        first = t.save_checkpoint()
        t.train_step()
        newest = t.save_checkpoint()
        state = newest / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
        with pytest.warns(UserWarning) as record:
            resumed = Trainer(_config(model_config(), tmp_path, keep_checkpoints=2), train_corpus=corpus())
        assert resumed.step == 1
        messages = [str(w.message) for w in record]
        assert any("step_0000002: cannot read trainer_state.pt" in m for m in messages), messages
        assert any("resumed from the older" in m and m.count("step_0000001") == 1 for m in messages), messages
        state = first / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:100])
        with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"step_0000002: cannot read trainer_state"):
            Trainer(_config(model_config(), tmp_path, keep_checkpoints=2), train_corpus=corpus())


def test_torn_last_metrics_line_is_dropped(tmp_path, model_config, corpus):
    """A run killed while writing metrics.jsonl leaves a torn last line: resume drops it with a
    warning; a malformed line elsewhere is an error naming the file and the line."""
    with fuseformer.use_backend("reference"):
        t = Trainer(_config(model_config(), tmp_path, save_every=1, max_steps=1), train_corpus=corpus())
        t.train()
        metrics = tmp_path / "metrics.jsonl"
        with metrics.open("a") as f:
            f.write('{"step": 2, "loss": 3.4')  # killed mid-line
        with pytest.warns(UserWarning, match=r"metrics\.jsonl line 2 is incomplete"):
            Trainer(_config(model_config(), tmp_path, save_every=1, max_steps=2), train_corpus=corpus()).train()
        assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
        metrics.write_text('{"step": 1, "loss": 3.4}\nnot json\n{"step": 2, "loss": 3.3}\n')
        with pytest.raises(ValueError, match=rf"{metrics} line 2 is not a JSON object"):
            Trainer(_config(model_config(), tmp_path, save_every=1, max_steps=3), train_corpus=corpus()).train()
