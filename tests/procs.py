"""Child processes of this process, read from /proc: what a mesh starts and must not leave behind."""
import os
import time


def children() -> set[int]:
    """Live child processes of this process (from /proc)."""
    pids: set[int] = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                pids.update(int(x) for x in f.read().split())
        except FileNotFoundError:
            pass
    return {p for p in pids if _alive(p)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False
