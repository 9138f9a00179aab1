"""Every Triton op takes its launch configs through the autotune cache (runtime/autotune.py):

- with nothing cached, each op resolves exactly the config it used before the cache (the H200-measured
  tables and rules, hard-coded here so that a silent change fails);
- a config stored for the op's key is the one it launches with, and a launcher's explicit ``config=``
  still wins over it;
- a corrupt cache file or a stored config that does not fit is ignored with a warning;
- the lookup happens once per plan (shape bucket, flags, dtype, device), not per call.
"""

import importlib

import pytest
import torch

import fuseformer
from fuseformer.ops._utils import covers_row
from fuseformer.runtime import autotune

RN = importlib.import_module("fuseformer.ops.rms_norm")
RN_BWD = importlib.import_module("fuseformer.ops.rms_norm_bwd")
LN = importlib.import_module("fuseformer.ops.layer_norm")
ACT = importlib.import_module("fuseformer.ops.activations")
ROT = importlib.import_module("fuseformer.ops.rotary")
CE = importlib.import_module("fuseformer.ops.cross_entropy")
PA = importlib.import_module("fuseformer.ops.paged_attention")
ATT = importlib.import_module("fuseformer.ops.attention")
ATT_CFG = importlib.import_module("fuseformer.ops._attention_common")  # attention's launch configs
ATT_BWD = importlib.import_module("fuseformer.ops.attention_bwd")

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEFORMER_CACHE_DIR", str(tmp_path))
    autotune.clear_memory()
    yield tmp_path
    autotune.clear_memory()


@pytest.fixture
def h200(monkeypatch):
    """Resolve configs as on an H200 from the built-in tables and rules (shipped tuned tables, which
    a GPU run may change, left out)."""
    monkeypatch.setattr(autotune, "gpu_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(autotune, "_shipped", lambda kernel: {})
    monkeypatch.setattr(ATT_CFG, "INTERPRET", False)
    autotune.clear_memory()


def _pick(cfg: dict, *names: str) -> tuple:
    return tuple(cfg[n] for n in names)


# --------------------------------------------------------------------------------------------
# Defaults: the pre-cache values (tables and rules as of the H200 sweeps of 2026-11-30)
# --------------------------------------------------------------------------------------------
# (n, residual) -> (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps).
RMS_FWD = {
    (100, False): (16, 128, True, 4, False),
    (1024, False): (8, 1024, True, 4, False),
    (4096, False): (4, 4096, True, 8, False),
    (4096, True): (1, 4096, False, 16, True),  # RELOAD: the fused add + norm default since run 38
    (3000, True): (1, 4096, False, 16, True),
    (8192, True): (2, 8192, True, 8, False),
    (16384, False): (1, 16384, True, 16, False),
    (65536, False): (1, 8192, False, 16, False),
}
# n -> (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps, programs_per_sm)
RMS_BWD = {
    512: (16, 512, True, 8, 4),
    1024: (8, 1024, True, 8, 4),
    2048: (4, 2048, True, 8, 2),
    4096: (2, 4096, True, 8, 2),
    5000: (1, 8192, True, 4, 2),
    16384: (1, 16384, True, 16, 2),
    32768: (1, 8192, False, 16, 2),
}
# n -> (BLOCK_P, BLOCK_N, num_warps)
RMS_DW = {1024: (512, 8, 4), 4096: (128, 32, 4), 5000: (64, 64, 4)}
# n -> (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps)
LN_FWD = {128: (16, 128, True, 4), 1024: (4, 1024, True, 8), 16384: (1, 16384, True, 16), 20000: (1, 4096, False, 8)}
# n -> (BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps, programs_per_sm)
LN_BWD = {64: (16, 64, True, 4, 4), 1024: (2, 1024, True, 8, 4), 8192: (1, 8192, True, 16, 4),
          10000: (1, 2048, False, 8, 4)}  # fmt: skip
# (n, dtype, backward) -> (BLOCK_M, BLOCK_N, num_warps)
GLU = {
    (14336, BF16, False): (2, 1024, 4),
    (14336, BF16, True): (2, 1024, 8),
    (100, FP32, False): (8, 128, 4),
    (3, BF16, False): (512, 4, 4),
}
# (seqlen, nheads, half, passthrough) -> (BLOCK_M, BLOCK_H, BLOCK_K, BLOCK_P, num_warps)
ROTARY = {
    (4096, 32, 64, 0): (2, 32, 64, 1, 8),
    (4096, 8, 64, 0): (8, 8, 64, 1, 8),
    (3, 8, 64, 0): (4, 8, 64, 1, 4),
    (1, 2, 16, 4): (1, 2, 16, 4, 2),
}
# v -> (BLOCK_V, num_warps)
CE_CFG = {128256: (8192, 16), 32768: (8192, 16), 32000: (4096, 8), 2048: (2048, 8), 1000: (1024, 4)}
# (max_seqlen_q, group, head_dim, element size) -> (BLOCK_M, BLOCK_N, num_warps, num_stages, HEADS)
PAGED = {
    (1, 4, 128, 2): (16, 64, 4, 3, 4),
    (4096, 4, 128, 2): (128, 64, 8, 3, 4),
    (1, 4, 256, 2): (16, 32, 8, 2, 4),
    (1, 4, 64, 4): (16, 32, 8, 1, 4),
    (16, 8, 128, 4): (16, 32, 8, 1, 8),
}
# (kind, block_d, bounded) -> KernelConfig fields (BLOCK_M, BLOCK_N, num_warps, num_stages)
ATTN = {
    ("fwd", 128, True): (128, 128, 8, 3),
    ("fwd", 128, False): (128, 64, 4, 2),
    ("fwd", 64, True): (64, 128, 4, 2),
    ("fwd", 64, False): (128, 128, 4, 3),
    ("fwd", 256, False): (128, 64, 8, 2),
    ("fwd", 16, True): (128, 64, 4, 3),
    ("bwd_dkdv", 32, True): (64, 128, 8, 2),
    ("bwd_dkdv", 64, True): (32, 64, 4, 2),
    ("bwd_dkdv", 128, False): (64, 64, 4, 2),
    ("bwd_dkdv", 256, True): (32, 64, 8, 2),
    ("bwd_dq", 16, True): (128, 64, 8, 2),
    ("bwd_dq", 64, True): (64, 64, 4, 2),
    ("bwd_dq", 128, False): (64, 64, 4, 2),
    ("bwd_dq", 256, True): (64, 64, 8, 2),
}
ATTN_INTERPRET = {"fwd": (32, 16, 4, 1), "bwd_dkdv": (16, 32, 4, 1), "bwd_dq": (32, 16, 4, 1)}
NORM4 = ("BLOCK_M", "BLOCK_N", "SINGLE_PASS", "num_warps")
KC = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


@pytest.mark.parametrize("gpu", ["cpu", "h200"])
def test_defaults_are_the_pre_cache_values(gpu, request):
    if gpu == "h200":
        request.getfixturevalue("h200")
    for (n, res), want in RMS_FWD.items():
        for dtype in (BF16, FP32):
            cfg = RN.fwd_config(n, res, dtype, "cpu")
            assert _pick(cfg, *NORM4, "RELOAD") == want and set(cfg) == {*NORM4, "RELOAD"}, (n, res)
            assert RN._fwd_plan(n, res, True, True, dtype, torch.device("cpu"))[1] == want[0]
    for n, want in RMS_BWD.items():
        assert _pick(RN_BWD.bwd_config(n, False, BF16, -1), *NORM4, "programs_per_sm") == want, n
        assert _pick(RN_BWD.bwd_config(n, True, FP32, -1), *NORM4, "programs_per_sm") == want, n
    for n, want in RMS_DW.items():
        assert _pick(RN_BWD.dw_config(n, -1), "BLOCK_P", "BLOCK_N", "num_warps") == want, n
        assert RN_BWD._dw_plan(n)[0].kwargs == dict(zip(("BLOCK_P", "BLOCK_N", "num_warps"), want, strict=True))
    for n, want in LN_FWD.items():
        assert _pick(LN.fwd_config(n, False, BF16, "cpu"), *NORM4) == want, n
        assert _pick(LN.fwd_config(n, True, FP32, "cpu"), *NORM4) == want, n
    for n, want in LN_BWD.items():
        assert _pick(LN.bwd_config(n, False, BF16, "cpu"), *NORM4, "programs_per_sm") == want, n
    for (n, dtype, bwd), want in GLU.items():
        assert _pick(ACT.glu_config(n, dtype, bwd, "cpu"), "BLOCK_M", "BLOCK_N", "num_warps") == want, n
    for (s, h, half, p), want in ROTARY.items():
        cfg = ROT.rotary_config(ROT._seqlen_bucket(s), h, half, p, BF16, "cpu")
        assert _pick(cfg, "BLOCK_M", "BLOCK_H", "BLOCK_K", "BLOCK_P", "num_warps") == want, (s, h, half, p)
    for v, want in CE_CFG.items():
        for grad in (False, True):
            assert _pick(CE.ce_config(v, grad, BF16, "cpu"), "BLOCK_V", "num_warps") == want, v
    for args, want in PAGED.items():
        assert _pick(PA._attn_config(*args), *KC, "HEADS") == want, args
    for (kind, block_d, bounded), want in ATTN.items():
        cfg = ATT_CFG.kernel_config(kind, block_d, bounded, BF16, "cpu")
        expected = ATTN_INTERPRET[kind] if ATT_CFG.INTERPRET else want
        assert _pick(_fields(cfg), *KC) == expected, (kind, block_d)
        assert cfg.warp_specialize == 0


def _fields(cfg) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__slots__}


def test_attention_keeps_the_interpreter_configs():
    """Under TRITON_INTERPRET=1 (how CI runs) the small interpreter configs stay the default."""
    if not ATT_CFG.INTERPRET:
        pytest.skip("not under the interpreter")
    for kind, want in ATTN_INTERPRET.items():
        assert _pick(_fields(ATT_CFG.kernel_config(kind, 128, True, torch.float16, "cpu")), *KC) == want


def test_keys():
    assert RN.config_key(3000, True, BF16) == "N4096-add-bfloat16" == RN.config_key(4096, True, BF16)
    assert LN.config_key(100, False, FP32) == "N128-norm-float32"
    assert ACT.config_key(14336, BF16) == "N16384-bfloat16"
    assert ROT.config_key(16, 8, 64, 0, BF16) == "S16-H8-K64-P0-bfloat16"
    assert CE.config_key(128256, True, BF16) == "V131072-grad-bfloat16"
    assert PA.config_key(True, 16, 128, 2) == "decode-R16-D128-E2"
    assert ATT_CFG.config_key(128, False, torch.float16) == "D128-full-float16"


# --------------------------------------------------------------------------------------------
# A stored config is what the op uses
# --------------------------------------------------------------------------------------------
class _LauncherSpy:
    """Wraps a _utils.Launcher: records each launch's LaunchConfig kwargs, then launches."""

    def __init__(self, real):
        self.real, self.seen = real, []

    def __call__(self, grid, cfg, *args):
        self.seen.append(dict(cfg.kwargs))
        return self.real(grid, cfg, *args)


def test_rms_norm_launches_with_stored_configs(monkeypatch):
    m, n = 37, 200
    fwd = dict(BLOCK_M=2, BLOCK_N=256, SINGLE_PASS=True, num_warps=2, RELOAD=False)
    bwd = dict(BLOCK_M=1, BLOCK_N=64, SINGLE_PASS=False, num_warps=2, programs_per_sm=3)
    dw = dict(BLOCK_P=8, BLOCK_N=16, num_warps=1)
    autotune.store(RN.FWD_KERNEL, RN.config_key(n, True, FP32), fwd, "cpu")
    autotune.store(RN_BWD.BWD_KERNEL, RN.config_key(n, False, FP32), bwd, "cpu")
    autotune.store(RN_BWD.DW_KERNEL, f"N{autotune.bucket(n)}", dw, "cpu")
    modules = dict(_fwd_launcher=RN, _bwd_launcher=RN_BWD, _dw_launcher=RN_BWD)
    spies = {name: _LauncherSpy(getattr(mod, name)) for name, mod in modules.items()}
    for name, spy in spies.items():
        monkeypatch.setattr(modules[name], name, spy)
    x, r, w, dy = torch.randn(m, n), torch.randn(m, n), torch.randn(n), torch.randn(m, n)
    y, h, rstd = RN.rms_norm_fwd(x, w, r, 1e-6)
    dx, dw_out = RN.rms_norm_bwd(dy, h, w, rstd)
    assert {k: spies["_fwd_launcher"].seen[0][k] for k in fwd} == fwd
    assert spies["_bwd_launcher"].seen[0] == dict(HAS_DH=False, HAS_WEIGHT=True, BLOCK_M=1, BLOCK_N=64,
                                                   SINGLE_PASS=False, num_warps=2)  # fmt: skip
    assert spies["_dw_launcher"].seen[0] == dw
    # The stored configs compute the same results.
    y_ref, h_ref = RN.rms_norm_ref(x, w, 1e-6, r)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    RN.rms_norm_ref(hd, wd, 1e-6).backward(dy.double())
    torch.testing.assert_close(dx, hd.grad.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw_out, wd.grad.float(), rtol=1e-4, atol=1e-3)
    # Another key (no residual) keeps the default; explicit config= still wins over the cache.
    assert RN.fwd_config(n, False, FP32, "cpu") == RN.default_config(n)
    explicit = dict(BLOCK_M=4, BLOCK_N=256, SINGLE_PASS=True, num_warps=4)
    RN.rms_norm_fwd(x, w, r, 1e-6, config=explicit)
    assert {k: spies["_fwd_launcher"].seen[-1][k] for k in explicit} == explicit
    RN.rms_norm_bwd(dy, h, w, rstd, programs_per_sm=5)  # the stored config, other programs per SM
    assert spies["_bwd_launcher"].seen[-1]["BLOCK_N"] == 64


def test_other_ops_resolve_stored_configs():
    autotune.store(LN.FWD_KERNEL, LN.config_key(1000, False, FP32), dict(BLOCK_M=1, BLOCK_N=256,
                   SINGLE_PASS=False, num_warps=2), "cpu")  # fmt: skip
    autotune.store(LN.BWD_KERNEL, LN.config_key(1000, True, FP32), dict(BLOCK_M=2, BLOCK_N=1024,
                   SINGLE_PASS=True, num_warps=4, programs_per_sm=1), "cpu")  # fmt: skip
    autotune.store(ACT.BWD_KERNEL, ACT.config_key(100, BF16), dict(BLOCK_M=4, BLOCK_N=64, num_warps=2), "cpu")
    autotune.store(ROT.KERNEL, ROT.config_key(16, 8, 64, 0, BF16), dict(BLOCK_M=4, BLOCK_H=2, num_warps=1), "cpu")
    autotune.store(CE.KERNEL, CE.config_key(32000, False, BF16), dict(BLOCK_V=1024, num_warps=2), "cpu")
    autotune.store(PA.KERNEL, PA.config_key(True, 16, 128, 2), dict(BLOCK_M=32, BLOCK_N=16, num_warps=2,
                   num_stages=1), "cpu")  # fmt: skip
    assert LN.fwd_config(1000, False, FP32, "cpu")["BLOCK_N"] == 256
    assert LN.fwd_config(1000, True, FP32, "cpu") == LN._fwd_config(1000)
    assert LN.bwd_config(1000, True, FP32, "cpu")["programs_per_sm"] == 1
    assert ACT.glu_config(100, BF16, True, "cpu") == dict(BLOCK_M=4, BLOCK_N=64, num_warps=2)
    assert ACT.glu_config(100, BF16, False, "cpu") == ACT._config(100, 2, False)
    # Rotary: the stored tile and warps; BLOCK_K and BLOCK_P still follow the shape.
    assert ROT.rotary_config(16, 8, 64, 0, BF16, "cpu") == dict(BLOCK_M=4, BLOCK_H=2, BLOCK_K=64, BLOCK_P=1,
                                                                num_warps=1)  # fmt: skip
    assert CE.ce_config(32000, False, BF16, "cpu") == dict(BLOCK_V=1024, num_warps=2)
    assert CE.ce_config(32000, True, BF16, "cpu") == dict(BLOCK_V=4096, num_warps=8)
    cfg = PA._attn_config(1, 4, 128, 2, "cpu")
    assert _pick(cfg, *KC, "HEADS") == (32, 16, 2, 1, 4)
    # An explicit config (paged_attention_fwd's config=) goes on top of the cached one, for that call only.
    assert _pick(PA._attn_config(1, 4, 128, 2, "cpu", dict(BLOCK_M=16)), *KC, "HEADS") == (16, 16, 2, 1, 4)
    assert PA._attn_config(1, 4, 128, 2, "cpu")["BLOCK_M"] == 32


def test_ops_run_with_stored_configs():
    """The launchers pass their dtype and device: a stored config reaches the kernel (and works)."""
    x = torch.randn(5, 100)
    autotune.store(LN.FWD_KERNEL, LN.config_key(100, False, FP32), dict(BLOCK_M=2, BLOCK_N=32,
                   SINGLE_PASS=False, num_warps=1), "cpu")  # fmt: skip
    y, _, _, _ = LN.layer_norm_fwd(x, None, None, None, 1e-5)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (100,), eps=1e-5), rtol=1e-5, atol=1e-5)
    autotune.store(CE.KERNEL, CE.config_key(100, False, FP32), dict(BLOCK_V=16, num_warps=1), "cpu")
    target = torch.randint(0, 100, (5,))
    loss, _ = CE.cross_entropy_fwd(x, target, -100, 0.0, 0.0)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(x, target, reduction="none"))
    gate, up = torch.randn(3, 100), torch.randn(3, 100)
    autotune.store(ACT.FWD_KERNEL, ACT.config_key(100, FP32), dict(BLOCK_M=1, BLOCK_N=16, num_warps=1), "cpu")
    torch.testing.assert_close(ACT.glu_fwd(gate, up, "silu"), ACT.glu_ref(gate, up, "silu"))


def test_attention_stored_config_under_an_explicit_config():
    stored = dict(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1, warp_specialize=0)
    autotune.store(ATT_CFG.KERNELS["fwd"], ATT_CFG.config_key(32, True, torch.float16), stored, "cpu")
    autotune.store(ATT_CFG.KERNELS["bwd_dq"], ATT_CFG.config_key(32, False, torch.float16), stored, "cpu")
    fwd = lambda config=None: _fields(ATT_CFG.resolve_config("fwd", config, 32, True, torch.float16, "cpu"))  # noqa: E731
    assert fwd() == stored == _fields(ATT_CFG.kernel_config("fwd", 32, True, torch.float16, "cpu"))
    # A launcher's config= goes on top of the cached lookup, for that call only: never hidden by the cache.
    assert fwd(dict(BLOCK_N=32)) == dict(stored, BLOCK_N=32)
    assert fwd() == stored
    # The key is per (head dim, causal or full, dtype).
    assert _fields(ATT_CFG.kernel_config("fwd", 32, False, torch.float16, "cpu")) != stored
    assert _fields(ATT_CFG.kernel_config("fwd", 32, True, torch.bfloat16, "cpu")) != stored
    assert _fields(ATT_CFG.kernel_config("bwd_dq", 32, False, torch.float16, "cpu")) == stored


def test_attention_launchers_ask_with_their_shape(monkeypatch):
    """flash_attention_fwd / _bwd resolve the config of their (head dim, bound, dtype, device)."""
    configs = {k: dict(BLOCK_M=16, BLOCK_N=16, num_warps=1 + i, num_stages=1, warp_specialize=0)
               for i, k in enumerate(ATT_CFG.KERNELS)}  # fmt: skip
    for kind, cfg in configs.items():
        autotune.store(ATT_CFG.KERNELS[kind], ATT_CFG.config_key(32, False, torch.float16), cfg, "cpu")
    seen = []

    def spy(kernel, grid_fn, cfg, args, consts, key):
        seen.append(_fields(cfg))
        return cfg

    monkeypatch.setattr(ATT, "launch", spy)
    monkeypatch.setattr(ATT_BWD, "launch", spy)
    q, k, v = (torch.randn(1, 8, 2, 32, dtype=torch.float16) for _ in range(3))
    out, lse = ATT.flash_attention_fwd(q, k, v, None, None, 8, 8, 0.2, -1, -1)
    lse.zero_()
    ATT_BWD.flash_attention_bwd(out.zero_(), q, k, v, out, lse, None, None, None, 8, 8, 0.2, -1, -1)
    assert seen == [configs["fwd"], configs["bwd_dkdv"], configs["bwd_dq"]]


# --------------------------------------------------------------------------------------------
# Bad cache entries are ignored with a warning; lookups are once per plan
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", [RN.FWD_KERNEL, ATT_CFG.KERNELS["fwd"], CE.KERNEL])
def test_a_corrupt_cache_file_is_ignored_with_a_warning(kernel):
    path = autotune.cache_path(kernel, "cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        if kernel == RN.FWD_KERNEL:
            assert RN.fwd_config(4096, True, BF16, "cpu") == RN.default_config(4096, True)
        elif kernel == CE.KERNEL:
            assert CE.ce_config(32000, True, BF16, "cpu") == CE._config(32000)
        else:
            cfg = ATT_CFG.kernel_config("fwd", 128, True, BF16, "cpu")
            assert cfg == ATT_CFG.default_config("fwd", 128, True)


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(BLOCK_M=2, BLOCK_N=4096), "fields"),  # missing fields
        (dict(BLOCK_M=2, BLOCK_N=4096, SINGLE_PASS=True, num_warps=8, EXTRA=1), "fields"),
        (dict(BLOCK_M=2, BLOCK_N=4096, SINGLE_PASS=True, num_warps=8), "fields"),  # no RELOAD (before run 38)
        (dict(BLOCK_M=2, BLOCK_N=2048, SINGLE_PASS=True, num_warps=8, RELOAD=False), "does not fit"),  # row of 4096
    ],
)
def test_a_stored_config_that_does_not_fit_is_ignored(cfg, match):
    autotune.store(RN.FWD_KERNEL, RN.config_key(4096, False, FP32), cfg, "cpu")
    with pytest.warns(UserWarning, match=match):
        assert RN.fwd_config(4096, False, FP32, "cpu") == RN.default_config(4096)
    # The forward still runs (on the default) and is right.
    x = torch.randn(3, 4096)
    with pytest.warns(UserWarning, match=match):
        y, _, _ = RN.rms_norm_fwd(x, None, None, 1e-6)
    torch.testing.assert_close(y, RN.rms_norm_ref(x, None, 1e-6), rtol=1e-5, atol=1e-5)


def test_the_lookup_happens_once_per_plan(monkeypatch):
    calls = []
    real = autotune.get_config

    def counting(kernel, key, **kw):
        calls.append(kernel)
        return real(kernel, key, **kw)

    monkeypatch.setattr(autotune, "get_config", counting)
    x, w = torch.randn(4, 64), torch.randn(64)
    with fuseformer.use_backend("triton"):
        for _ in range(3):
            fuseformer.ops.rms_norm(x, w)
            ATT_CFG.kernel_config("fwd", 64, True, torch.float16, "cpu")
    assert calls == [RN.FWD_KERNEL, ATT_CFG.KERNELS["fwd"]]
    # A store empties the plans: the next call looks the new config up.
    autotune.store(RN.FWD_KERNEL, RN.config_key(64, False, FP32), RN.default_config(64), "cpu")
    with fuseformer.use_backend("triton"):
        fuseformer.ops.rms_norm(x, w)
    assert calls[-1] == RN.FWD_KERNEL and len(calls) == 3


# --------------------------------------------------------------------------------------------
# Tuning candidates (what bench/tune.py times)
# --------------------------------------------------------------------------------------------
def test_candidates_start_with_the_default_and_fit():
    for n in (1024, 4096, 8192, 65536):
        for res in (False, True):
            for quick in (False, True):
                cands = RN.candidate_configs(n, res, quick)
                assert cands[0] == RN.default_config(n, res) and len(cands) > 1
                assert all(set(c) == set(RN._FWD_FIELDS) and covers_row(n)(c) for c in cands)
                assert len(cands) <= 8 or not quick
        cands = RN_BWD.candidate_configs(n, quick=True)
        assert cands[0] == RN_BWD.default_config(n)
        assert all(set(c) == set(RN_BWD._BWD_FIELDS) and covers_row(n)(c) for c in cands)
    for kind in ATT_CFG.KERNELS:
        for block_d, bounded in ((64, True), (128, False), (256, True)):
            for quick in (False, True):
                cands = ATT_CFG.candidate_configs(kind, block_d, bounded, quick)
                assert cands[0] == _fields(ATT_CFG.default_config(kind, block_d, bounded))
                assert all(set(c) == set(ATT_CFG._FIELDS) for c in cands) and len(cands) > 1
                assert len(cands) <= 8 or not quick
