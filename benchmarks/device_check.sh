#!/usr/bin/env bash
# The GPU check, in one run (about 7 minutes on an H100 by the step times
# of 2026-12-05; the steps' limits add up to 9): the cuDNN attention tests,
# benchmarks/train_throughput.py for `base`, `big` and `llama_125m` (GQA,
# RoPE, SwiGLU) in bfloat16 with einsum
# and with cuDNN attention (MFU against the H100's and H200's 989 TFLOP/s
# dense bf16 peak) and benchmarks/decode_throughput.py; one JSON of all
# figures.
#
#   bash benchmarks/device_check.sh --prepare   # here, with the network:
#       downloads the wheels the device lacks into benchmarks/wheels (git
#       ignores it, 0.7 MiB: the device run names it in its carried paths)
#   bash benchmarks/device_check.sh [OUT.json]  # on the device (no network;
#       default OUT device_check.json, the steps' logs in /tmp/device_check.*)
#   bash benchmarks/device_check.sh --cpu [OUT.json]  # a rehearsal on CPU:
#       the small model, tiny batches, 'fused' attention in place of cuDNN
#
# The device's python has jax with its CUDA plugin, flax, optax, orbax,
# sentencepiece and sacrebleu but no TensorFlow, tensorflow-datasets or
# ml-collections; nothing here needs the first two, and the missing pure
# Python packages (ml-collections, pytest) come from benchmarks/wheels,
# unpacked into a folder on PYTHONPATH, never from the network.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=benchmarks/wheels
# Module to import -> the wheels it needs (beyond what the device has).
needs=("ml_collections:ml-collections" "pytest:pytest pluggy iniconfig packaging")

if [ "${1:-}" = --prepare ]; then
  mkdir -p "$wheels"
  for need in "${needs[@]}"; do
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" \
      ${need#*:}
  done
  ls -l "$wheels"; du -sh "$wheels"
  exit 0
fi

mode=gpu
if [ "${1:-}" = --cpu ]; then mode=cpu; shift; fi
out=$(realpath -m "${1:-device_check.json}")
work=$(mktemp -d /tmp/device_check.XXXXXX)
export PYTHONPATH="$PWD:$work/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # A step that times out keeps its output.
started=$(date +%s)

# The wheels are pure Python (py3-none-any): unpacked onto PYTHONPATH they
# are installed, for this run only, with neither pip nor the network.
for need in "${needs[@]}"; do
  module=${need%%:*}
  python3 -c "import $module" 2>/dev/null && continue
  for package in ${need#*:}; do
    wheel=$(ls "$wheels/${package//-/_}"-*-py3-none-any.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
      echo "device_check: $module is missing and $wheels has no wheel of" \
           "$package: run 'bash benchmarks/device_check.sh --prepare' on a" \
           "machine with the network first" >&2
      exit 1
    fi
    python3 -m zipfile -e "$wheel" "$work/site"
  done
  python3 -c "import $module" || exit 1
done

if [ $mode = gpu ]; then
  export JAX_PLATFORMS=cuda,cpu  # tests/conftest.py defaults to cpu.
  attentions=(einsum cudnn)
  sizes=(--steps 10)
  # 8k tokens a side each for translation; 16 rows of 2048 for the LM.
  train_rows=(base:--rows=128 llama_125m:--rows=16 big:--rows=64)
  decode=(--models small --engines jaxformer --source_len 64 --batch 64)
  peak=989e12
  scale=1
else
  export JAX_PLATFORMS=cpu
  attentions=(einsum fused)
  sizes=(--steps 2 --length 8)
  # base and big take minutes each to compile in bfloat16 on 2 CPU cores:
  # the rehearsal runs the same code on the small model (and llama_125m,
  # which compiles in seconds with scanned layers).
  train_rows=(small:--rows=2 llama_125m:--rows=2)
  decode=(--models small --engines jaxformer --batch 2 --source_len 8 --output_len 8
          --rounds 1)
  peak=0
  scale=6  # 2 loaded CPU cores, bfloat16 emulated.
fi

run() {  # name, seconds, command...: the command's output in $work/name.log
  local name=$1 seconds=$2; shift 2
  echo "== $name: $*"
  local t0; t0=$(date +%s)
  timeout $(( seconds * scale )) "$@" > "$work/$name.log" 2>&1
  local rc=$?
  tail -4 "$work/$name.log"
  echo "$name $rc $(( $(date +%s) - t0 ))" >> "$work/status"
}

# The cuDNN attention tests (skipped without a GPU), the choice of kernel
# per platform and the fused (XLA) attention beside them.
run tests 50 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/model/test_kernels.py tests/model/test_attention.py \
  -k 'cudnn or auto or platform or fused'
# Limits (seconds, x6 on CPU): on an H100, base and big compile in 30 to
# 45 s each (XLA's autotuning), llama_125m (scanned layers) in 8 to 14 s.
declare -A limit=([base]=80 [big]=95 [llama_125m]=50 [small]=60)
for preset in "${train_rows[@]}"; do
  for attention in "${attentions[@]}"; do
    run "train_${preset%%:*}_$attention" "${limit[${preset%%:*}]}" python3 \
      benchmarks/train_throughput.py --config "${preset%%:*}" \
      "${preset#*:}" --dtype bfloat16 --attention "$attention" \
      --peak_flops "$peak" "${sizes[@]}" \
      --json "$work/train_${preset%%:*}_$attention.json"
  done
done
run decode 40 python3 benchmarks/decode_throughput.py "${decode[@]}" \
  --json "$work/decode.json"

python3 - "$work" "$out" "$mode" "$started" <<'EOF'
import json, os, platform, sys, time
work, out, mode, started = sys.argv[1:]
import jax
report = {'mode': mode, 'jax': jax.__version__,
          'devices': [d.device_kind for d in jax.devices()],
          'python': platform.python_version(),
          'seconds': round(time.time() - int(started)), 'steps': {}}
for line in open(os.path.join(work, 'status')):
  name, rc, seconds = line.split()
  log = open(os.path.join(work, f'{name}.log')).read().splitlines()
  step = {'exit': int(rc), 'seconds': int(seconds), 'tail': log[-3:]}
  figures = os.path.join(work, f'{name}.json')
  if os.path.exists(figures):
    step['figures'] = json.load(open(figures))
  report['steps'][name] = step
json.dump(report, open(out, 'w'), indent=2)
failed = [n for n, s in report['steps'].items() if s['exit']]
print(f'device_check: {out}, {report["seconds"]} s; '
      + (f'FAILED: {failed}' if failed else 'all steps passed'))
sys.exit(1 if failed else 0)
EOF
