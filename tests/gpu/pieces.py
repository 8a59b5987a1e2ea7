"""Wheels carried to the GPU machine in pieces (docs/gpu.md, "vLLM on the GPU machine").

A device call carries at most 64 MiB, the working tree included, and vLLM's CUDA wheel alone is
larger. Here the wheels become one byte stream, cut into numbered pieces with a manifest of
checksums; there, each call checks the piece it brought, and the last one joins them back into
the same wheels, byte for byte. Standard library only: it runs on the device image as it is.

    python tests/gpu/pieces.py strip WHEEL OUT PATTERN...   a copy of WHEEL without the members that match
    python tests/gpu/pieces.py pack DIR WHEEL... --mib N    DIR/piece-NN + DIR/manifest.json
    python tests/gpu/pieces.py check DIR [K]                piece K (or every piece) there and intact
    python tests/gpu/pieces.py join DIR DEST                the wheels, checked, into DEST
    python tests/gpu/pieces.py standin DIR                  two stand-in wheels for the dry mode
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import shutil
import sys
import zipfile
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 1 << 20


class PieceError(Exception):
    """A piece or wheel missing or not what the manifest says: one line for the caller."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def strip(wheel: Path, out: Path, patterns: list[str]) -> list[str]:
    """Copy `wheel` to `out` without the members whose path matches one of `patterns` (fnmatch).
    RECORD still lists them: `pip install --no-deps` installs such a wheel (checked on the CPU),
    and what a Hopper run never loads need not travel. Returns the dropped members."""
    dropped = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
        for info in src.infolist():
            if any(fnmatch.fnmatch(info.filename, p) for p in patterns):
                dropped.append(info.filename)
                continue
            with src.open(info) as f_in, dst.open(info, "w") as f_out:
                shutil.copyfileobj(f_in, f_out, CHUNK)
    return dropped


def pack(folder: Path, wheels: list[Path], *, piece_bytes: int, about: dict | None = None) -> dict:
    """The wheels, in order, as one stream cut into folder/piece-01, -02, ... of at most
    `piece_bytes` each, and folder/manifest.json (each piece's and each wheel's size and sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("piece-*"):
        old.unlink()
    pieces, current, written = [], None, 0

    def next_piece():
        nonlocal current, written
        if current:
            current.close()
        current = open(folder / f"piece-{len(pieces) + 1:02d}", "wb")
        pieces.append(current.name)
        written = 0

    next_piece()
    for wheel in wheels:
        with open(wheel, "rb") as f:
            while block := f.read(CHUNK):
                while block:
                    if written == piece_bytes:
                        next_piece()
                    take = block[: piece_bytes - written]
                    current.write(take)
                    written += len(take)
                    block = block[len(take):]
    current.close()
    manifest = {
        **(about or {}),
        "pieces": [{"name": Path(p).name, "bytes": Path(p).stat().st_size, "sha256": sha256(Path(p))} for p in pieces],
        "wheels": [{"name": w.name, "bytes": w.stat().st_size, "sha256": sha256(w)} for w in wheels],
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise PieceError(f"no {path}: carry the kit's manifest with each piece (tests/gpu/prepare.sh --vllm makes it)")
    return json.loads(path.read_text())


def check(folder: Path, k: int | None = None) -> list[str]:
    """Piece k (1-based), or every piece, present with the manifest's size and checksum."""
    m = read_manifest(folder)
    todo = m["pieces"] if k is None else m["pieces"][k - 1: k]
    if not todo:
        raise PieceError(f"piece {k}: the manifest lists {len(m['pieces'])} pieces")
    for p in todo:
        path = folder / p["name"]
        if not path.is_file():
            raise PieceError(f"{path} is missing: carry it (one piece a call, in order: docs/gpu.md)")
        if path.stat().st_size != p["bytes"] or sha256(path) != p["sha256"]:
            raise PieceError(f"{path} is damaged ({path.stat().st_size} bytes, the manifest says {p['bytes']}): "
                             "carry it again")
    return [p["name"] for p in todo]


def join(folder: Path, dest: Path) -> list[Path]:
    """Every piece checked, then the stream cut back into the manifest's wheels in `dest`, each
    checked against its own checksum."""
    m = read_manifest(folder)
    check(folder)
    dest.mkdir(parents=True, exist_ok=True)
    streams = (open(folder / p["name"], "rb") for p in m["pieces"])
    src = next(streams)
    out = []
    for w in m["wheels"]:
        path, left = dest / w["name"], w["bytes"]
        with open(path, "wb") as f:
            while left:
                block = src.read(min(left, CHUNK))
                if not block:
                    src.close()
                    src = next(streams)
                    continue
                f.write(block)
                left -= len(block)
        if sha256(path) != w["sha256"]:
            raise PieceError(f"{path.name}: joined, its checksum is not the manifest's")
        out.append(path)
    src.close()
    return out


def standin(folder: Path) -> list[Path]:
    """Two installable wheels for the dry mode (prepare-vllm.sh --dry): a vLLM stand-in holding
    the members the real wheel drops (and metadata that requires torch, as vLLM's does), and a
    dependency of incompressible bytes, so that the stream crosses pieces inside a wheel."""
    import base64
    import os

    def wheel(name: str, files: dict[str, bytes], requires: list[str]) -> Path:
        dist = f"{name}-0.0.0.dist-info"
        meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", "Version: 0.0.0",
                          *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
        files = {**files, f"{dist}/METADATA": meta.encode(),
                 f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: minirl\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
        record = []
        for path, data in files.items():
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        files[f"{dist}/RECORD"] = ("\n".join(record + [f"{dist}/RECORD,,"]) + "\n").encode()
        path = folder / f"{name}-0.0.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for member, data in files.items():
                z.writestr(zipfile.ZipInfo(member, date_time=(2026, 1, 1, 0, 0, 0)), data)
        return path

    folder.mkdir(parents=True, exist_ok=True)
    vllm = wheel("minirl_standin_vllm", {
        "minirl_standin_vllm/__init__.py": b'__version__ = "0.0.0"\n',
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": os.urandom(4096),
        "vllm/vllm-rs": os.urandom(4096)}, ["torch==2.13.0", "regex", "pydantic>=2.12.0"])
    dep = wheel("minirl_standin_dep", {"minirl_standin_dep/__init__.py": b"",
                                       "minirl_standin_dep/blob.bin": os.urandom(96 * 1024)}, [])
    return [vllm, dep]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pieces.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("strip")
    s.add_argument("wheel", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("patterns", nargs="+")
    p = sub.add_parser("pack")
    p.add_argument("folder", type=Path)
    p.add_argument("wheels", type=Path, nargs="+")
    p.add_argument("--mib", type=float, required=True)
    p.add_argument("--about", default="{}", help="JSON merged into the manifest (versions, what was dropped)")
    c = sub.add_parser("check")
    c.add_argument("folder", type=Path)
    c.add_argument("k", type=int, nargs="?")
    j = sub.add_parser("join")
    j.add_argument("folder", type=Path)
    j.add_argument("dest", type=Path)
    sub.add_parser("standin").add_argument("folder", type=Path)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "strip":
            dropped = strip(a.wheel, a.out, a.patterns)
            print(json.dumps(dropped))
        elif a.cmd == "pack":
            m = pack(a.folder, a.wheels, piece_bytes=int(a.mib * 2**20), about=json.loads(a.about))
            total = sum(p["bytes"] for p in m["pieces"])
            print(f"pieces: {len(m['wheels'])} wheels, {total / 2**20:.1f} MiB in {len(m['pieces'])} pieces in {a.folder}")
        elif a.cmd == "standin":
            print(" ".join(str(p) for p in standin(a.folder)))
        elif a.cmd == "check":
            names = check(a.folder, a.k)
            print(f"pieces: {', '.join(names)} intact")
        else:
            paths = join(a.folder, a.dest)
            print(f"pieces: {len(paths)} wheels joined into {a.dest}, each checked")
    except PieceError as e:
        print(f"pieces: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
