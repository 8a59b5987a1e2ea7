#!/usr/bin/env bash
# The GPU check (docs/gpu.md): install what the device image lacks from .gpu/ (tests/gpu/prepare.sh
# fills it beforehand), run tests/gpu and the bench, and write report.md and report.json (with
# the logs) into $MINIRL_GPU_OUT, else $OUT, else ./gpu-report. About 5 minutes on an H100.
#   bash tests/gpu/run-on-device.sh          on the GPU machine
#   bash tests/gpu/run-on-device.sh --dry    the same steps on this CPU with the tiny model and the
#                                            installed packages (tests/test_gpu_kit.py runs it in CI)
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0
case "${1:-}" in
  --dry) dry=1 ;;
  "") ;;
  *) echo "usage: bash tests/gpu/run-on-device.sh [--dry]" >&2; exit 2 ;;
esac
out=${MINIRL_GPU_OUT:-${OUT:-gpu-report}}
py=${PYTHON:-python3}
mkdir -p "$out" && rm -f "$out"/{outcomes.jsonl,figures.jsonl,bench.json,report.json,report.md}
export PYTHONUNBUFFERED=1 MINIRL_GPU_REPORT="$out" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ $dry = 1 ]; then
  export MINIRL_GPU_DRY=1
else
  kit=${MINIRL_GPU_KIT:-.gpu}
  if ! ls "$kit"/*.whl >/dev/null 2>&1; then
    echo "run-on-device: no wheels in $kit/: run bash tests/gpu/prepare.sh on the dev machine and carry .gpu" >&2
    exit 2
  fi
  site=$(mktemp -d /tmp/minirl-gpu-site.XXXX)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$kit"/*.whl || exit 2
  export PYTHONPATH="$site:$(cd "$kit" && pwd):$PYTHONPATH"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
t0=$SECONDS
# the tests have 6 minutes, the bench 2.5: 9 in all with the install and the report
timeout 360 "$py" -m pytest tests/gpu -m gpu -p no:cacheprovider -q -rfEs --timeout 300 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 150 "$py" tests/gpu/bench.py --out "$out" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
"$py" tests/gpu/report.py "$out" > /dev/null
report_rc=$?
echo "run-on-device: tests exit $tests_rc, bench exit $bench_rc, $((SECONDS - t0)) s; report in $out/report.md"
[ $tests_rc = 0 ] && [ $bench_rc = 0 ] && [ $report_rc = 0 ]
