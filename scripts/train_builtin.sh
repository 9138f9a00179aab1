#!/usr/bin/env bash
# Train the built-in model on a CUDA GPU (`fuseformer train --preset builtin`), export it as a bf16
# Hugging Face directory and pack it for the trip back: OUT_DIR/builtin.tgz.part-aa, -ab, ...
# (the device tool returns files of at most 16 MiB). Unpack here with scripts/unpack_builtin.sh.
#
#   bash scripts/train_builtin.sh OUT_DIR
set -euo pipefail
out="${1:?OUT_DIR}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
run=/tmp/builtin-run
rm -rf "$run" /tmp/builtin
python3 -m fuseformer.cli train --preset builtin --out-dir "$run" --export /tmp/builtin 2>&1 | tr '\r' '\n' | grep -v '^\s*$' > "$out/train-builtin.log"
tail -n 5 "$out/train-builtin.log"
cp "$run/metrics.jsonl" "$out/builtin-metrics.jsonl"

tar -C /tmp -czf /tmp/builtin.tgz builtin
split -b 12M /tmp/builtin.tgz "$out/builtin.tgz.part-"
ls -la /tmp/builtin "$out"
