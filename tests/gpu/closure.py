"""Whether the wheels a kit carries need anything that neither the device image nor the kit has:
each wheel's declared requirements (markers evaluated for the image's Python 3.12 on x86-64 Linux)
against the image's `pip list` (tests/gpu/image-packages.txt, saved by the first piece's call) and
the kit's own wheels. vLLM's own requirements are left to image_check.py on the machine: most of
them are imported lazily. Run by prepare-vllm.sh before it cuts the pieces.

    python tests/gpu/closure.py IMAGE_LIST WHEEL...     prints what is missing; exit 2 if anything is
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# the device image's interpreter (run-on-device.sh --piece 1 prints it)
IMAGE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
             "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
             "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
LAZY = {"vllm", "minirl-standin-vllm"}  # image_check.py's business


def image_packages(path: Path) -> dict[str, str]:
    rows = (line.strip() for line in path.read_text().splitlines())
    return {canonicalize_name(n): v for n, _, v in (r.partition("==") for r in rows if r and not r.startswith("#"))}


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(IMAGE_ENV)]


def wheel_name(wheel: Path) -> str:
    return canonicalize_name(re.split(r"-\d", wheel.name, maxsplit=1)[0])


def unmet(wheels: list[Path], image: dict[str, str]) -> list[str]:
    """'NEED (for WHEEL)' for each requirement of a carried wheel that is neither on the image nor carried."""
    carried = {wheel_name(w) for w in wheels}
    missing = []
    for w in wheels:
        if wheel_name(w) in LAZY:
            continue
        for r in requirements(w):
            name = canonicalize_name(r.name)
            if name not in carried and name not in image:
                missing.append(f"{r} (for {w.name})")
    return missing


def main(argv: list[str]) -> int:
    image, *wheels = argv
    missing = unmet([Path(w) for w in wheels], image_packages(Path(image)))
    for line in missing:
        print(f"closure: neither the image nor the kit has {line}", file=sys.stderr)
    return 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
