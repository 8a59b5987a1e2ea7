"""What the device image holds of vLLM's declared requirements, run by the first piece's call
(run-on-device.sh --piece 1), before the big install: for each requirement, whether the image has
it and at a version the requirement accepts, or whether the kit carries it. Standard library (and
`packaging`, which the image's pip and transformers have) only.

    python3 tests/gpu/image_check.py KIT_DIR [OUT_DIR]     prints a table; OUT_DIR/image.json
"""

from __future__ import annotations

import json
import platform
import re
import sys
from importlib import metadata
from pathlib import Path


def _name(wheel: str) -> str:
    return re.sub(r"[-_.]+", "-", wheel.split("-", 1)[0]).lower()


def check(manifest: dict) -> list[dict]:
    from packaging.requirements import Requirement

    carried = {_name(w["name"]) for w in manifest["wheels"]}
    rows = []
    for line in manifest.get("requires", []):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if name in carried:
            state = "carried"
        elif have is None:
            state = "missing"  # imported lazily or guarded, or the import will say
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            state = "other version"
        else:
            state = "ok"
        rows.append({"requirement": line.split(";")[0].strip(), "image": have, "state": state})
    return rows


def main(argv: list[str]) -> int:
    kit = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else None
    manifest = json.loads((kit / "manifest.json").read_text())
    rows = check(manifest)
    libc = " ".join(platform.libc_ver())
    print(f"image: Python {platform.python_version()}, {libc}; the kit's vLLM {manifest.get('vllm')}")
    for state in ("other version", "missing", "carried", "ok"):
        group = [r for r in rows if r["state"] == state]
        if group:
            print(f"{state} ({len(group)}): " + ", ".join(
                r["requirement"] + (f" [image {r['image']}]" if r["image"] and state != "ok" else "") for r in group))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "image.json").write_text(json.dumps({"python": platform.python_version(), "libc": libc,
                                                    "vllm": manifest.get("vllm"), "requirements": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
