#!/usr/bin/env bash
# Fill .gpu/ (git-ignored) with what run-on-device.sh installs on the GPU machine's fixed image
# (Python 3.12, torch 2.11 + CUDA, no network, none of minirl's dependencies but torch and
# transformers): TorchTitan, torchao and their pure-Python needs as py3.12 x86-64 wheels, at the
# versions of .ci/constraints-cpu.txt (what CI tested), and the torch 2.11 stand-in from
# ../shared/tools/gpu. Run it here (it needs a package registry), then carry .gpu to the device.
#   bash tests/gpu/prepare.sh                  the trainer's kit (.gpu/*.whl + the stand-in)
#   bash tests/gpu/prepare.sh --vllm           and vLLM in pieces (.gpu/vllm/): prepare-vllm.sh
#   bash tests/gpu/prepare.sh --vllm --dry     vLLM's pieces from stand-in wheels, no registry (CI)
set -euo pipefail
cd "$(dirname "$0")/../.."
vllm=0
dry=0
for a in "$@"; do
  case "$a" in
    --vllm) vllm=1 ;;
    --dry) dry=1 ;;
    *) echo "usage: bash tests/gpu/prepare.sh [--vllm [--dry]]" >&2; exit 2 ;;
  esac
done
if [ $vllm = 1 ]; then
  if [ $dry = 1 ]; then exec bash tests/gpu/prepare-vllm.sh --dry; fi
  bash tests/gpu/prepare-vllm.sh
fi
[ $dry = 0 ] || { echo "prepare: --dry goes with --vllm" >&2; exit 2; }
kit=.gpu
shim=${MINIRL_GPU_SHIM:-../shared/tools/gpu/torch211_shim.py}
wheels=(torchtitan torchao spmd_types torch_checkpointing tyro docstring_parser typeguard torchdata)
mkdir -p "$kit"
specs=()
for w in "${wheels[@]}"; do
  pin=$(grep -i -E "^${w//_/[-_]}==" .ci/constraints-cpu.txt || true)
  [ -n "$pin" ] || { echo "prepare: $w is not in .ci/constraints-cpu.txt" >&2; exit 2; }
  specs+=("$pin")
done
py=.venv/bin/python
[ -x "$py" ] || py=python3
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  plats+=(--platform "$p")
done
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" -d "$kit" "${specs[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
[ -f "$shim" ] || { echo "prepare: no $shim (the torch 2.11 stand-in); set MINIRL_GPU_SHIM" >&2; exit 2; }
cp "$shim" "$kit/"
echo "prepare: $(ls "$kit"/*.whl | wc -l) wheels and $(basename "$shim") in $kit/ ($(du -sh "$kit" | cut -f1))"
# the embedded default workspace for the sequence's (a) steps (tests/gpu/sequence.py), made here as
# README's first command makes it, carried as .gpu-ws/ without the cold start's DCP copy (a run reads
# the HF folder): ~5 MB
if [ ! -f .gpu-ws/minirl.toml ]; then
  tmp=$(mktemp -d /tmp/minirl-gpu-ws.XXXX)
  .venv/bin/minirl init "$tmp/ws" > "$tmp/init.log" 2>&1 || { tail -3 "$tmp/init.log" >&2; exit 2; }
  rm -rf "$tmp/ws/model/coldstart-dcp"
  # its run on this CPU, the reference the GPU's held-out gain is read against (the cold start, and
  # so every figure after it, differs by CPU): a copy runs, the workspace keeps its summary's figures
  cp -r "$tmp/ws" "$tmp/cpu"
  .venv/bin/minirl run "$tmp/cpu" > "$tmp/run.log" 2>&1 || { tail -3 "$tmp/run.log" >&2; exit 2; }
  .venv/bin/python tests/gpu/sequence.py reference "$tmp/cpu" "$tmp/ws/cpu-reference.json"
  mv "$tmp/ws" .gpu-ws && rm -rf "$tmp"
fi
echo "prepare: the embedded default workspace in .gpu-ws/ ($(du -sh .gpu-ws | cut -f1))"
echo "prepare: this visit's device calls: .venv/bin/python tests/gpu/sequence.py plan"
