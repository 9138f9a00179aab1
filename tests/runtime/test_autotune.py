"""The autotune cache: lookup order, tuning, a second process reusing the stored config without
tuning, corrupt and stale files ignored with a warning, atomic writes, shipped defaults."""

import importlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fuseformer
from fuseformer.runtime import autotune

M = importlib.import_module("fuseformer.ops.mlp")
CONFIGS = [dict(BLOCK=32), dict(BLOCK=64), dict(BLOCK=128)]
FAKE_MS = {32: 3.0, 64: 1.0, 128: 2.0}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEFORMER_CACHE_DIR", str(tmp_path))
    autotune.clear_memory()
    yield tmp_path
    autotune.clear_memory()


def _fake_timer(fn):
    return fn()


def _bench(cfg):
    return lambda: FAKE_MS[cfg["BLOCK"]]


def test_tune_picks_the_fastest_and_stores_it(cache_dir):
    best = autotune.tune("toy", CONFIGS, _bench, "T64", timer=_fake_timer)
    assert best == dict(BLOCK=64)
    path = autotune.cache_path("toy", "cpu")
    assert path.parent == cache_dir and path.exists()
    data = json.loads(path.read_text())
    assert data["configs"] == {"T64": {"BLOCK": 64}}
    assert data["gpu"] == "cpu" and data["triton"] == autotune.triton_version() and data["version"] == 1
    assert not [p for p in cache_dir.iterdir() if p.suffix == ".tmp"]
    assert autotune.get_config("toy", "T64") == dict(BLOCK=64)
    assert autotune.get_config("toy", "T128", default=dict(BLOCK=1)) == dict(BLOCK=1)
    assert autotune.get_config("toy", "T128", default=lambda: dict(BLOCK=2)) == dict(BLOCK=2)


def test_tune_reuses_the_cache_unless_forced():
    autotune.tune("toy", CONFIGS, _bench, "T64", timer=_fake_timer)

    def must_not_run(cfg):
        raise AssertionError("tuned again")

    assert autotune.tune("toy", CONFIGS, must_not_run, "T64", timer=_fake_timer) == dict(BLOCK=64)
    fast_128 = {32: 3.0, 64: 1.0, 128: 0.5}
    best = autotune.tune("toy", CONFIGS, lambda c: (lambda: fast_128[c["BLOCK"]]), "T64", force=True,
                         timer=_fake_timer)  # fmt: skip
    assert best == dict(BLOCK=128)


def test_failing_configs_are_skipped_and_all_failing_raises():
    def bench(cfg):
        if cfg["BLOCK"] == 64:
            raise RuntimeError("out of resources")
        return lambda: FAKE_MS[cfg["BLOCK"]]

    assert autotune.tune("toy", CONFIGS, bench, "T8", timer=_fake_timer) == dict(BLOCK=128)
    with pytest.raises(RuntimeError, match="every config of toy failed"):
        autotune.tune("toy", CONFIGS, lambda c: 1 / 0, "T9", timer=_fake_timer)


def test_second_process_reuses_the_stored_config_without_tuning(cache_dir):
    autotune.tune("toy", CONFIGS, _bench, "T64", timer=_fake_timer)
    script = (
        "from fuseformer.runtime import autotune\n"
        "def bench(cfg):\n"
        "    raise SystemExit('tuned in the second process')\n"
        "print(autotune.tune('toy', [dict(BLOCK=1)], bench, 'T64', timer=lambda fn: 0.0),"
        " autotune.lookup('toy', 'T64')[1])\n"
    )
    env = dict(os.environ, FUSEFORMER_CACHE_DIR=str(cache_dir), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "{'BLOCK': 64} cache"


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "unreadable"),
        ("[1, 2]", "not a fuseformer autotune file"),
        (json.dumps(dict(version=99, kernel="toy", gpu="cpu", triton="x", configs={"T64": {"BLOCK": 7}})), "stale"),
    ],
)
def test_corrupt_or_stale_cache_is_ignored_with_a_warning(content, match):
    path = autotune.cache_path("toy", "cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    with pytest.warns(UserWarning, match=match):
        assert autotune.get_config("toy", "T64", default=dict(BLOCK=0)) == dict(BLOCK=0)
    # Tuning over a bad file replaces it with a good one.
    autotune.tune("toy", CONFIGS, _bench, "T64", timer=_fake_timer)
    autotune.clear_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.get_config("toy", "T64") == dict(BLOCK=64)


def test_stale_triton_version_is_ignored():
    path = autotune.cache_path("toy", "cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(version=1, kernel="toy", gpu="cpu", triton="0.0.1", configs={"T64": {"BLOCK": 7}})
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="stale"):
        assert autotune.get_config("toy", "T64") is None


def test_a_failed_write_leaves_the_old_file_and_no_temporary(cache_dir, monkeypatch):
    autotune.store("toy", "T1", dict(BLOCK=1))
    before = autotune.cache_path("toy", "cpu").read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(autotune.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        autotune.store("toy", "T2", dict(BLOCK=2))
    assert autotune.cache_path("toy", "cpu").read_text() == before
    assert [p.name for p in cache_dir.iterdir()] == [autotune.cache_path("toy", "cpu").name]


def test_store_merges_entries_written_by_another_process():
    autotune.store("toy", "T1", dict(BLOCK=1))
    data = json.loads(autotune.cache_path("toy", "cpu").read_text())
    data["configs"]["T2"] = {"BLOCK": 2}  # another process wrote T2 meanwhile
    autotune.cache_path("toy", "cpu").write_text(json.dumps(data))
    autotune.store("toy", "T3", dict(BLOCK=3))
    assert set(json.loads(autotune.cache_path("toy", "cpu").read_text())["configs"]) == {"T1", "T2", "T3"}


def test_shipped_defaults_by_gpu_family(monkeypatch):
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"):
        monkeypatch.setattr(autotune, "gpu_name", lambda device=None, name=name: name)
        key = M.config_key(8192, 4096, 14336, torch.bfloat16)
        cfg, source = autotune.lookup(M.KERNEL, key, generic_key=M.generic_key(8192, torch.bfloat16))
        assert source == "shipped" and set(cfg) == set(M.CONFIG_KEYS), name
        small = M.config_key(3, 4096, 14336, torch.bfloat16)  # no entry of its own: the T bucket's
        cfg, source = autotune.lookup(M.KERNEL, small, generic_key=M.generic_key(3, torch.bfloat16))
        assert source == "shipped" and cfg["BLOCK_M"] == 16
    monkeypatch.setattr(autotune, "gpu_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert autotune.lookup(M.KERNEL, "T16-bfloat16", generic_key="T16-bfloat16") == (None, "none")


def test_bucket_and_family():
    assert [autotune.bucket(n) for n in (1, 2, 3, 64, 65, 8192, 8193)] == [1, 2, 4, 64, 128, 8192, 16384]
    assert autotune.bucket(3, minimum=16) == 16
    assert autotune.gpu_family("NVIDIA H100 80GB HBM3") == "H100" and autotune.gpu_family("NVIDIA H200") == "H200"
    assert M.config_key(1, 4096, 14336, torch.bfloat16) == M.config_key(16, 4096, 14336, torch.bfloat16)
    assert M.config_key(17, 4096, 14336, torch.bfloat16) == M.config_key(32, 4096, 14336, torch.bfloat16)


def test_fused_mlp_launches_with_the_cached_config(monkeypatch):
    """The op asks the cache: a config stored for its key is the one the kernel is launched with."""
    t, h, i = 5, 32, 48
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=1, USE_DESC=False)
    autotune.store(M.KERNEL, M.config_key(t, h, i, torch.float32), cfg)
    seen = []
    real = M._mlp_gate_up_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append({k: kwargs[k] for k in M.CONFIG_KEYS})
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(M, "_mlp_gate_up_kernel", Spy())
    x = torch.randn(t, h)
    wgu, wd = torch.randn(2 * i, h), torch.randn(h, i)
    with fuseformer.use_backend("triton"):
        out = fuseformer.ops.fused_mlp(x, wgu, wd)
    assert seen == [cfg]
    torch.testing.assert_close(out, M.fused_mlp_ref(x, wgu, wd), rtol=1e-4, atol=1e-4)


def test_ship_merges_tuned_files_into_the_shipped_tables(cache_dir, tmp_path_factory):
    """What a GPU run tuned becomes a shipped default for its GPU family; other entries stay; a
    file that is not a cache file is skipped with a warning."""
    autotune.store("toy", "T64", dict(BLOCK=64))
    path = autotune.cache_path("toy", "cpu")
    data = json.loads(path.read_text())
    h200 = path.with_name("toy--NVIDIA_H200--x.json")
    h200.write_text(json.dumps(dict(data, gpu="NVIDIA H200", configs={"T64": {"BLOCK": 32}, "T8": {"BLOCK": 16}})))
    junk = cache_dir / "junk.json"
    junk.write_text("{not json")
    shipped = tmp_path_factory.mktemp("shipped")
    (shipped / "toy.json").write_text(json.dumps({"gpus": {"H200": {"T64": {"BLOCK": 128}, "T1": {"BLOCK": 8}}}}))
    with pytest.warns(UserWarning, match="skipping"):
        assert autotune._main(["ship", str(cache_dir), "--into", str(shipped)]) == 0
    gpus = json.loads((shipped / "toy.json").read_text())["gpus"]
    assert gpus["H200"] == {"T64": {"BLOCK": 32}, "T8": {"BLOCK": 16}, "T1": {"BLOCK": 8}}
    assert gpus["cpu"] == {"T64": {"BLOCK": 64}}
    assert autotune._main(["ship", str(shipped / "missing-dir")]) == 1
    assert autotune._main(["ship", str(tmp_path_factory.mktemp("empty"))]) == 1
