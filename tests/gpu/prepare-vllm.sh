#!/usr/bin/env bash
# vLLM for the GPU machine, in pieces (docs/gpu.md, "vLLM on the GPU machine"): the CUDA wheel of
# the GPU lock's vLLM (.ci/constraints-gpu.txt; MINIRL_VLLM_VERSION=0.24.0 is the fallback whose
# requirements name the image's torch 2.11 exactly) without what a Hopper run never loads, and the
# packages it imports at module level that the device image lacks, as py3.12 x86-64 wheels; cut
# into pieces of MINIRL_PIECE_MIB (48) MiB with a manifest of checksums in MINIRL_VLLM_KIT
# (.gpu-vllm). Each device call carries one piece; the last one joins and installs them.
#   bash tests/gpu/prepare-vllm.sh          needs a package registry (about 330 MB downloaded)
#   bash tests/gpu/prepare-vllm.sh --dry    the same steps on stand-in wheels, offline (CI)
set -euo pipefail
cd "$(dirname "$0")/../.."
dry=0
case "${1:-}" in
  --dry) dry=1 ;;
  "") ;;
  *) echo "usage: bash tests/gpu/prepare-vllm.sh [--dry]" >&2; exit 2 ;;
esac
kit=${MINIRL_VLLM_KIT:-.gpu-vllm}
mib=${MINIRL_PIECE_MIB:-48}
py=.venv/bin/python
[ -x "$py" ] || py=python3
pin() {  # the GPU lock's version of a package, if it has one
  grep -i -E "^${1//[-_]/[-_]}==" .ci/constraints-gpu.txt | head -1 | cut -d= -f3
}
version=${MINIRL_VLLM_VERSION:-$(pin vllm)}
# what a Hopper run never loads: FA2 (compute capability 9.x takes FA3; its import is inside a
# try) and the Rust front end (used only when asked for)
drop=('vllm/vllm_flash_attn/_vllm_fa2_C*.so' 'vllm/vllm-rs')
# imported at module level by `from vllm import LLM` and the offline engine's modules, and absent
# from the device image (../shared/docs/VLLM-ON-GPU.md); what openai 3 needs (httpx2, found on the
# H200 on 2026-11-27), compressed-tensors with loguru (FP8's quantization config imports it there),
# and the CLI's packages the image lacks (datasets, math-verify) for the `minirl run` test;
# tests/gpu/image_check.py says on the machine what else its image lacks
deps=(pydantic pydantic-core typing-inspection annotated-types typing-extensions cbor2 pyzmq
      openai httpx2 httpcore2 truststore sniffio distro jiter httpx httpcore h11 anyio msgspec pybase64 cachetools
      fastapi annotated-doc starlette partial-json-parser llguidance xgrammar apache-tvm-ffi
      compressed-tensors loguru
      datasets dill multiprocess math-verify latex2sympy2-extended antlr4-python3-runtime)
if [ "${version%%.*}" = 0 ] && [ "$(echo "$version" | cut -d. -f2)" -lt 30 ]; then
  deps+=(openai-harmony)  # the name 0.24 imports; 0.32 imports its successor
else
  deps+=(oss-harmony)
fi
work=$(mktemp -d /tmp/minirl-vllm-prepare.XXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/dl" "$work/wheels"
if [ $dry = 1 ]; then
  # a vLLM stand-in wheel holding the members the real one drops, and one dependency: the
  # procedure (strip, pieces, manifest, join, install) with bytes that matter nothing
  version=0.0.0
  "$py" tests/gpu/pieces.py standin "$work/dl" > /dev/null
else
  plats=()
  for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64; do
    plats+=(--platform "$p")
  done
  # and the GPU sequence's peer (tests/gpu/trl_peer.py): TRL at the version tests/bench/speed.py pins
  specs=("vllm==$version" "trl==1.16.0")
  for d in "${deps[@]}"; do
    v=$(pin "$d")
    specs+=("$d${v:+==$v}")
  done
  echo "prepare-vllm: downloading vllm $version and ${#deps[@]} packages (py3.12, x86-64)"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" -d "$work/dl" "${specs[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
fi
wheels=()
dropped='[]'
for w in "$work"/dl/*.whl; do
  name=$(basename "$w")
  case "$name" in
    vllm-*|minirl_standin_vllm-*)
      dropped=$("$py" tests/gpu/pieces.py strip "$w" "$work/wheels/$name" "${drop[@]}")
      # vLLM's declared requirements, for the machine's check of its image (image_check.py)
      "$py" - "$w" > "$work/requires.json" <<'EOF'
import json, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
print(json.dumps([line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                  if line.startswith("Requires-Dist:") and "extra ==" not in line]))
EOF
      ;;
    *) cp "$w" "$work/wheels/$name" ;;
  esac
  wheels+=("$work/wheels/$name")
done
about=$("$py" -c 'import json, sys; print(json.dumps({"vllm": sys.argv[1], "dry": sys.argv[2] == "1",
  "dropped": json.loads(sys.argv[3]), "requires": json.load(open(sys.argv[4]))}))' \
  "$version" "$dry" "$dropped" "$work/requires.json")
if [ $dry = 0 ]; then  # what the carried wheels need is on the image or carried (openai 3's httpx2 was not)
  "$py" tests/gpu/closure.py tests/gpu/image-packages.txt "${wheels[@]}" \
    || { echo "prepare-vllm: add what is missing to deps in $0" >&2; exit 2; }
fi
"$py" tests/gpu/pieces.py pack "$kit" "${wheels[@]}" --mib "$mib" --about "$about"
n=$(ls "$kit"/piece-* | wc -l)
echo "prepare-vllm: the device calls, back to back (docs/gpu.md; the visit's whole list: tests/gpu/sequence.py plan):"
for k in $(seq 1 $((n - 1))); do
  printf '  command="bash tests/gpu/run-on-device.sh --piece %d"  carry=["%s/manifest.json", "%s/piece-%02d"]\n' \
    "$k" "$kit" "$kit" "$k"
done
printf '  command="bash tests/gpu/run-on-device.sh --piece %d --install"  carry=[".gpu", "%s/manifest.json", "%s/piece-%02d"]\n' \
  "$n" "$kit" "$kit" "$n"
printf '  then the steps: command="bash tests/gpu/run-on-device.sh --step ID" (or the rollout half alone: --vllm, carrying the last piece)\n'
