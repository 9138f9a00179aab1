#!/usr/bin/env bash
# The GPU check: correctness at real sizes (tests marked `gpu`, bf16/fp16/fp32) and every benchmark,
# in one go, on a CUDA machine. Writes logs, JSON and PNG plots to OUT_DIR.
#
#   bash scripts/gpu_check.sh OUT_DIR [all|tests|bench|sweep|tune|serve|attention|gluon|engine|fp8|fp8train|optimize|so|glance|ordered] [bench suites...]
#
# sweep: the lab's sweeps (benchmarks/sweeps.py, not the installed package): SWEEPS="name ..." picks them
# (default: every one; `python3 benchmarks/sweeps.py --list` names them).
#
# gluon (not part of all): the GPU tests of the Gluon attention kernels at head dim 64 and of the fused
# MLP's Gluon gate-up, then sweeps attention_gluon, attention_gluon_bwd and mlp_gluon (configs, peers,
# the gate-up's token crossover).
#
# serve (not part of all): the serving GPU tests and `fuseformer bench serve`, in one device call.
#
# engine (not part of all): one device call (~8 min) for issues 28-29: the engine's GPU tests and paged
# attention's compile count and the sampling op (one process), the sampler's draw with and without seeds
# (benchmarks/seeded_sampling.py), the structured-outputs cost (benchmarks/structured_outputs_engine.py;
# needs llguidance: carry its wheel in .whl/, installed from there when present), and the mix, prefix and
# fixed workloads with the defaults, each the first run of its engine, with the Triton kernels compiled inside
# it (benchmarks/engine_workloads.py; WORKLOADS=mix,prefix to shorten, WORKLOAD_FLAGS="--eager --no-pieces"
# to add enforce_eager and the defaults less graph pieces); PIECES=1 adds benchmarks/piecewise_steps.py
# (mixed steps with and without graph pieces). JSON in OUT_DIR.
#
# fp8 (not part of all): issue 31 in one device call (~8 min): the FP8 GPU tests (the ops incl. weight-only
# decode, the built-in model's accuracy, the FP8 KV cache, the 200-step FP8 training run) in one process;
# benchmarks/fp8_gemm.py (the FP8 layers against bf16; the decode GEMMs' weight-only tiles at T 1 and 16,
# fp16 and bf16 MMA); benchmarks/fp8_engine.py (bf16, fp8, fp8 + fp8 KV cache over the same 8B-shape
# weights: batch1, fixed, prefill). fp8train: the training benchmark (--quick) with its float8 cases at the
# Llama-1B shape beside bf16 (needs torchao: carry its wheel in .whl/), a call of its own.
#
# optimize (not part of all): issue 26 in one device call (~9 min): the fusion GPU tests (one process), the
# BERT ablation (benchmarks/optimize_ablation.py: each kind alone, host time and syncs per forward), BERT's attention layer against
# SDPA's backends (benchmarks/encoder_attention.py), and
# `fuseformer bench optimize`'s encoder, prefill and generate cases (peers in the same process); the training
# case (HF + Liger: carry its wheel in .whl/) is OPTIMIZE_CASES=train, a call of its own.
#
# so (not part of all): issue 29's structured-outputs cost in one device call (~5 min): the grammar side of a first
# constrained run (benchmarks/so_first_run.py --other-first: compile and first fills per schema, no model), then
# benchmarks/structured_outputs_engine.py at full scale (256 x (256, 256), half under a JSON schema). Needs the
# grammar libraries and their imports: carry their wheels in .whl/ (docs/perf-notes.md says which).
#
# glance (not part of all): issue 27's no-regression check (benchmarks/glance_regression.py, ~5 min): the glance
# table's op cases for the package before issue 27 and now, alternating processes. The old package must be
# carried in .glance-old/ (made on the machine with the checkout: mkdir -p .glance-old && git archive fc8d9e1
# fuseformer ':!fuseformer/assets' | tar -x -C .glance-old).
#
# ordered (not part of all): issue 27's criterion, the GPU tests one directory a process, in order
# (ORDERED="tests/ops tests/engine ..."; default every directory with GPU tests), within DEADLINE seconds
# (default 570) of the stage's start. First a warm-up pass over the same directories with pytest-xdist
# (8 processes, at most WARM_S seconds, default 200; its results are not the check and go to its own log):
# it fills Triton's on-disk compile cache in parallel, so that the ordered runs, which pass or fail the
# check, compile little (tests/ops compiled alone needs ~660 s, more than one call). Each ordered run is
# stopped with SIGINT at the deadline, so pytest still prints its summary and --durations. MARK (default
# gpu) selects the tests: MARK="gpu or on_device" adds the tests that take the `device` fixture (cuda on a
# GPU host; tests/conftest.py marks them there), which `-m gpu` runs never take.
#
# attention (not part of all): the attention GPU tests at head dim 128 (the Gluon kernels and the cases
# they take), the attention layer's and the Llama model's, then `fuseformer bench attention --quick`, in one
# device call (~5 min; run 83 ran the tests in 158 s).
#
# tune (not part of all): `fuseformer bench --tune --quick`, its autotune cache files archived in
# OUT_DIR/tuned.tar.gz; ship them into the package's defaults afterwards, on the machine with the
# checkout: `tar -xzf OUT_DIR/tuned.tar.gz -C /tmp && python -m fuseformer.runtime.autotune ship /tmp/tuned`.
#
# bench runs ops (full) and attention, mlp_ce, engine, train (quick) unless suites are named;
# QUICK=1 makes ops quick too. All of it takes longer than one 10-minute device call: split it
# by stage or suite there.
#
# TESTS=path overrides which tests run (default: all of tests/). Run from the repository root; the package need not be installed (the root goes on PYTHONPATH).
set -uo pipefail
out="${1:-gpu-results}"
stage="${2:-all}"
shift $(( $# > 2 ? 2 : $# ))
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0

python3 -c "import torch, triton; print('gpu:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__)"

if [[ "$stage" == all || "$stage" == tests ]]; then
    python3 -m pytest -q -m gpu ${TESTS:-tests/} 2>&1 | tee "$out/gpu-tests.log" | tail -n 40
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ "$stage" == all || "$stage" == sweep ]]; then
    python3 benchmarks/sweeps.py ${SWEEPS:-$(python3 benchmarks/sweeps.py --list | cut -d' ' -f1)} --out "$out" \
        > "$out/sweep.log" 2>&1 || status=1
    tail -n 3 "$out/sweep.log"
fi
if [[ "$stage" == ordered ]]; then
    start=$SECONDS
    dirs=${ORDERED:-tests/ops tests/engine tests/serve tests/models tests/layers tests/train tests/fusion tests/bench}
    # Separate caches of tuned configs: the warm-up's tests must not write where the ordered runs read.
    FUSEFORMER_CACHE_DIR=$(mktemp -d) timeout -s INT "${WARM_S:-200}" python3 -m pytest -q -m "${MARK:-gpu}" -n 8 -p no:cacheprovider \
        $dirs > "$out/gpu-warm.log" 2>&1
    echo "warm-up pass: $((SECONDS - start)) s, $(tail -n 1 "$out/gpu-warm.log")"
    for d in $dirs; do
        left=$(( ${DEADLINE:-570} - (SECONDS - start) ))
        if (( left < 20 )); then echo "ordered: no time left for $d"; status=1; continue; fi
        name=$(echo "$d" | tr '/' '-')
        timeout -s INT "$left" python3 -m pytest -q -m "${MARK:-gpu}" -p no:cacheprovider --durations=25 "$d" \
            > "$out/gpu-$name.log" 2>&1
        rc=$?
        echo "$d: exit $rc at $((SECONDS - start)) s: $(grep -E ' in [0-9.]+s' "$out/gpu-$name.log" | tail -n 1)"
        (( rc == 0 || rc == 5 )) || status=1
    done
fi
if [[ "$stage" == attention ]]; then
    python3 -m pytest -q -m gpu tests/ops/test_attention.py tests/layers/test_attention.py tests/models/test_llama.py \
        -k "gluon or compiles or 128 or layers or llama" 2>&1 | tee "$out/gpu-tests-attention.log" | tail -n 15
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    python3 -m fuseformer.cli bench attention --quick --out "$out" > "$out/bench-attention.log" 2>&1 || status=1
    tail -n 40 "$out/bench-attention.log"
fi
if [[ "$stage" == gluon ]]; then
    python3 -m pytest -q -m gpu tests/ops/test_attention.py tests/ops/test_mlp.py -k "hd64 or gluon_gate_up" \
        2>&1 | tee "$out/gpu-tests-gluon.log" | tail -n 15
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    python3 benchmarks/sweeps.py attention_gluon attention_gluon_bwd mlp_gluon --out "$out" \
        > "$out/sweep-gluon.log" 2>&1 || status=1
    tail -n 3 "$out/sweep-gluon.log"
fi
if [[ ( "$stage" == engine || "$stage" == fp8 || "$stage" == fp8train || "$stage" == optimize || "$stage" == so ) ]] \
    && ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [[ "$stage" == fp8 ]]; then
    python3 -m pytest -q -m gpu -p no:randomly tests/ops/test_fp8.py tests/ops/test_fp8_decode.py tests/engine/test_fp8_accuracy.py \
        tests/engine/test_fp8_kv_cache.py tests/train/test_fp8.py tests/ops/test_paged_attention.py \
        tests/ops/test_reshape_and_cache.py 2>&1 | tee "$out/gpu-tests-fp8.log" | tail -n 8
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    OUT="$out" python3 benchmarks/fp8_gemm.py --tokens 1,16,256,4096 --parts layers,decode 2>&1 | grep -E '^#' || status=1
    OUT="$out" python3 benchmarks/fp8_engine.py "${FP8_CASES:-batch1,fixed,prefill}" 2>&1 | grep -v Warn | tail -n 8 || status=1
fi
if [[ "$stage" == fp8train ]]; then
    python3 -c "from fuseformer.train.bench import main; main()" --quick --json "$out/bench-train-fp8.json" 2>&1 \
        | tail -n 12 || status=1
fi
if [[ "$stage" == engine ]]; then
    python3 -m pytest -q -m gpu -p no:randomly tests/engine 2>&1 | tee "$out/gpu-tests-engine.log" | tail -n 5
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    python3 -m pytest -q -m gpu -p no:randomly --tb=short tests/ops/test_paged_attention.py tests/ops/test_sampling.py \
        -k "compiles_once or sampling" 2>&1 | tail -n 25
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    if [[ -n "${PIECES:-}" ]]; then
        OUT="$out" python3 benchmarks/piecewise_steps.py 2>&1 | grep -v Warn | tail -n 6 || status=1
    fi
    python3 benchmarks/seeded_sampling.py --out "$out/seeded_sampling.json" 2>&1 | tail -n 3 || status=1
    python3 benchmarks/structured_outputs_engine.py --out "$out/structured_outputs_engine.json" 2>&1 \
        | grep -v -i warn | tail -n 17 || status=1
    OUT="$out" python3 benchmarks/engine_workloads.py "${WORKLOADS:-mix,prefix,fixed}" ${WORKLOAD_FLAGS:-} 2>&1 \
        | grep -v Warn | tail -n 8 || status=1
    python3 -c "
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r['workload'], r['impl'], round(r['output_tok_s']), 'compiled', len(r['triton_compiles']), r['triton_compiles'][:3])
" "$out/workloads.json" || status=1
fi
if [[ "$stage" == optimize ]]; then
    python3 -m pytest -q -m gpu -p no:randomly tests/fusion 2>&1 | tee "$out/gpu-tests-fusion.log" | tail -n 5
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    python3 benchmarks/optimize_ablation.py --cases bert --out "$out" 2>&1 | grep -v Warn | tail -n 10 || status=1
    python3 benchmarks/encoder_attention.py --out "$out" 2>&1 | grep -E '^#|sdpa|default' | cut -c1-400 || status=1
    python3 -c "
import json, sys
from fuseformer.bench.optimize import bench_optimize, format_table
records = bench_optimize(cases=tuple(sys.argv[2].split(',')))
print(format_table(records))
json.dump(records, open(sys.argv[1], 'w'), indent=1)
" "$out/bench-optimize.json" "${OPTIMIZE_CASES:-encoder,prefill,generate}" 2>&1 | grep -v Warn | tail -n 16 || status=1
fi
if [[ "$stage" == so ]]; then
    python3 benchmarks/so_first_run.py --rows 128 --steps 48 --other-first --out "$out/so_first_run.json" 2>&1 \
        | grep '^#' || status=1
    python3 benchmarks/structured_outputs_engine.py --out "$out/structured_outputs_engine.json" \
        > "$out/structured_outputs_engine.log" 2>&1 || status=1
    grep -v -i warn "$out/structured_outputs_engine.log" | tail -n 20 | cut -c1-400
fi
if [[ "$stage" == glance ]]; then
    python3 benchmarks/glance_regression.py --old .glance-old --out "$out/glance.json" 2>&1 | tail -n 24 || status=1
fi
if [[ "$stage" == serve ]]; then
    # The serving checks in one device call (~7 min): the GPU tests of the engine and the serving
    # engine (CUDA graphs, sampling, overlap_prefill, the load test as served on CUDA),
    # then `fuseformer bench serve` (8B shape).
    python3 -m pytest -q -m gpu tests/serve/test_async_engine.py \
        tests/engine/test_cuda_graphs.py tests/engine/test_sampler.py tests/engine/test_llm.py \
        tests/engine/test_core.py \
        "tests/serve/test_load.py::test_gpu_256_concurrent_streams_at_real_layer_sizes[bfloat16-served]" \
        2>&1 | tee "$out/gpu-tests-serve.log" | tail -n 15
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    python3 -m fuseformer.cli bench serve --out "$out" > "$out/bench-serve.log" 2>&1 || status=1
    grep "bench serve" "$out/bench-serve.log" | tail -n 20
fi
if [[ "$stage" == tune ]]; then
    # The cache files go into one archive: the device tool brings back at most 8 files from $OUT (run 20
    # lost the rms_norm tables that way).
    tuned="$(mktemp -d)/tuned"
    FUSEFORMER_CACHE_DIR="$tuned" python3 -m fuseformer.cli bench --tune --quick > "$out/tune.log" 2>&1 || status=1
    tar -czf "$out/tuned.tar.gz" -C "$(dirname "$tuned")" tuned || status=1
    tail -n 5 "$out/tune.log"
fi
if [[ "$stage" == all || "$stage" == bench ]]; then
    # Every suite by default (ops in full, the long ones in quick mode); or the suites named.
    suites=("$@")
    [[ ${#suites[@]} -gt 0 ]] || suites=(ops attention mlp_ce engine train)
    for suite in "${suites[@]}"; do
        flags=()
        [[ "$suite" == ops && -z "${QUICK:-}" ]] || flags=(--quick)
        python3 -m fuseformer.cli bench "$suite" "${flags[@]}" --out "$out" > "$out/bench-$suite.log" 2>&1 || status=1
        tail -n 25 "$out/bench-$suite.log"
    done
fi
exit $status
