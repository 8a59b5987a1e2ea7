#!/usr/bin/env bash
# The GPU check (docs/gpu.md): install what the device image lacks from .gpu/ (tests/gpu/prepare.sh
# fills it beforehand), run tests/gpu and the bench, and write report.md and report.json (with
# the logs) into $MINIRL_GPU_OUT, else $OUT, else ./gpu-report. About 5 minutes on an H100.
#   bash tests/gpu/run-on-device.sh          on the GPU machine: the trainer's half
#   bash tests/gpu/run-on-device.sh --piece K  one of vLLM's pieces arrived intact (prepare-vllm.sh);
#                                            the first also checks the image against vLLM's needs
#   bash tests/gpu/run-on-device.sh --vllm   the rollout half: the pieces joined and installed with
#                                            the trainer's kit, tests/gpu -m vllm, the report
#   bash tests/gpu/run-on-device.sh --dry [--vllm]   the same steps on this CPU with the tiny model
#                                            and the installed packages (tests/test_gpu_kit.py, CI)
#   bash tests/gpu/run-on-device.sh [--dry] --step ID   one step of the GPU sequence (tests/gpu/sequence.py;
#                                            `sequence.py plan` lists a visit's calls): the kits are
#                                            installed once into .gpu-site/, which later calls reuse
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0
half=trainer
piece=
step=
install=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) dry=1 ;;
    --vllm) half=vllm ;;
    --piece) half=piece; piece=${2:-}; shift ;;
    --step) half=step; step=${2:-}; shift ;;
    --install) install=1 ;;
    *) echo "usage: bash tests/gpu/run-on-device.sh [--dry] [--vllm | --piece K [--install] | --step ID]" >&2; exit 2 ;;
  esac
  shift
done
vkit=${MINIRL_VLLM_KIT:-.gpu-vllm}
out=${MINIRL_GPU_OUT:-${OUT:-gpu-report}}
py=${PYTHON:-python3}
mkdir -p "$out" && rm -f "$out"/{outcomes.jsonl,figures.jsonl,bench.json,report.json,report.md}
export PYTHONUNBUFFERED=1 MINIRL_GPU_REPORT="$out" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
install_site() {  # the kits into .gpu-site/ (git-ignored: it stays on the machine between calls while it is warm)
  kit=${MINIRL_GPU_KIT:-.gpu}
  site=${MINIRL_GPU_SITE:-.gpu-site}
  [ -f "$site/.installed" ] && return 0
  rm -rf "$site" && mkdir -p "$site"
  ls "$kit"/*.whl >/dev/null 2>&1 || { echo "run-on-device: no wheels in $kit/: run bash tests/gpu/prepare.sh and carry .gpu" >&2; return 2; }
  if [ -f "$vkit/manifest.json" ]; then  # vLLM's pieces joined (each wheel checked against the manifest)
    wheels=$(mktemp -d /tmp/minirl-vllm-wheels.XXXX)
    "$py" tests/gpu/pieces.py join "$vkit" "$wheels" || return 2
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl || return 2
    rm -rf "$wheels"
    "$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vllm"])' "$vkit/manifest.json" > "$site/.vllm"
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$kit"/*.whl || return 2
  touch "$site/.installed"
}
if [ $half = piece ]; then  # a piece's call: it arrived intact; the first says what the image has
  "$py" tests/gpu/pieces.py check "$vkit" "$piece" 2>&1 | tee "$out/piece-$piece.log"
  rc=${PIPESTATUS[0]}
  if [ "$piece" = 1 ] && [ $rc = 0 ]; then
    "$py" tests/gpu/image_check.py "$vkit" "$out" 2>&1 | tee -a "$out/piece-$piece.log"
    "$py" -m pip list --format=freeze > "$out/pip-list.txt" 2>/dev/null
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  if [ $rc = 0 ] && [ $install = 1 ]; then  # the last piece: every piece is here, so the kits go in now
    t0=$SECONDS
    install_site || exit 2
    echo "run-on-device: vLLM and the trainer's kit installed into .gpu-site in $((SECONDS - t0)) s"
  fi
  exit $rc
fi
boot() {  # every process started from here on loads the torch 2.11 stand-in first (tests/gpu/boot/sitecustomize.py)
  export PYTHONPATH="${MINIRL_GPU_BOOT:-$PWD/tests/gpu/boot}:$1:$PYTHONPATH"
}
if [ $half = step ]; then  # a step of the sequence: the kits installed once per machine, then the step
  if [ $dry = 1 ]; then
    export MINIRL_GPU_DRY=1
    boot "$(cd "${MINIRL_GPU_SHIM_DIR:-../shared/tools/gpu}" && pwd)"  # the stand-in from where prepare.sh copies it
  else
    install_site || exit 2
    export PYTHONPATH="$(cd "$site" && pwd):$PYTHONPATH" VLLM_USE_DEEP_GEMM=0
    boot "$(cd "$kit" && pwd)"
    [ -f "$site/.vllm" ] && export MINIRL_VLLM_KIT_VERSION=$(cat "$site/.vllm")
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  t0=$SECONDS
  case "$step" in
    trainer-half)
      timeout 360 "$py" -m pytest tests/gpu -m "gpu and not vllm" -p no:cacheprovider -q -rfEs --timeout 300 2>&1 | tee "$out/tests.log"
      rc=${PIPESTATUS[0]}
      timeout 150 "$py" tests/gpu/bench.py --out "$out" 2>&1 | tee "$out/bench.log"
      [ ${PIPESTATUS[0]} = 0 ] || rc=1
      "$py" tests/gpu/report.py "$out" > /dev/null || rc=1 ;;
    vllm-half)
      timeout 480 "$py" -m pytest tests/gpu -m vllm -p no:cacheprovider -q -rfEs --timeout 420 2>&1 | tee "$out/tests.log"
      rc=${PIPESTATUS[0]}
      "$py" tests/gpu/report.py "$out" --no-bench > /dev/null || rc=1 ;;
    *)
      timeout 570 "$py" tests/gpu/sequence.py run "$step" --out "$out" 2>&1 | tee "$out/sequence.log"
      rc=${PIPESTATUS[0]} ;;
  esac
  echo "run-on-device: step $step, exit $rc, $((SECONDS - t0)) s; figures in $out/"
  exit $rc
fi
site=$(mktemp -d "${TMPDIR:-/tmp}/minirl-gpu-site.XXXX")
trap 'rm -rf "$site" ${wheels:+"$wheels"}' EXIT  # the kits' one-call install: gone when the call ends
if [ $half = vllm ]; then  # vLLM's pieces joined (each wheel checked) and installed first
  wheels=$(mktemp -d "${TMPDIR:-/tmp}/minirl-vllm-wheels.XXXX")
  "$py" tests/gpu/pieces.py join "$vkit" "$wheels" || exit 2
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl || exit 2
  rm -rf "$wheels"
  # vLLM picks DeepGEMM on Hopper when its module exists; 0.32's does not load on the image's torch
  export VLLM_USE_DEEP_GEMM=0 MINIRL_VLLM_KIT_VERSION=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vllm"])' "$vkit/manifest.json")
fi
if [ $dry = 1 ]; then
  export MINIRL_GPU_DRY=1
  [ $half = vllm ] && export PYTHONPATH="$PYTHONPATH:$site"  # the stand-ins, behind the installed vLLM
else
  kit=${MINIRL_GPU_KIT:-.gpu}
  if ! ls "$kit"/*.whl >/dev/null 2>&1; then
    echo "run-on-device: no wheels in $kit/: run bash tests/gpu/prepare.sh on the dev machine and carry .gpu" >&2
    exit 2
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$kit"/*.whl || exit 2
  export PYTHONPATH="$site:$PYTHONPATH"
  boot "$(cd "$kit" && pwd)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
if [ $half = vllm ]; then
  t0=$SECONDS
  # the rollout half has 8 minutes: one command's 10 with the join, the install and the report
  timeout 480 "$py" -m pytest tests/gpu -m vllm -p no:cacheprovider -q -rfEs --timeout 420 2>&1 | tee "$out/tests.log"
  tests_rc=${PIPESTATUS[0]}
  "$py" tests/gpu/report.py "$out" --no-bench > /dev/null
  report_rc=$?
  echo "run-on-device: rollout half, tests exit $tests_rc, $((SECONDS - t0)) s; report in $out/report.md"
  [ $tests_rc = 0 ] && [ $report_rc = 0 ]
  exit
fi
t0=$SECONDS
# the tests have 6 minutes, the bench 2.5: 9 in all with the install and the report
timeout 360 "$py" -m pytest tests/gpu -m "gpu and not vllm" -p no:cacheprovider -q -rfEs --timeout 300 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 150 "$py" tests/gpu/bench.py --out "$out" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
"$py" tests/gpu/report.py "$out" > /dev/null
report_rc=$?
echo "run-on-device: tests exit $tests_rc, bench exit $bench_rc, $((SECONDS - t0)) s; report in $out/report.md"
[ $tests_rc = 0 ] && [ $bench_rc = 0 ] && [ $report_rc = 0 ]
