"""The processes a supervisor started, read from /proc."""

from __future__ import annotations

from pathlib import Path


def children_of(pid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)


def alive(pid: int) -> bool:
    """True while `pid` is a live, not zombie, process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
