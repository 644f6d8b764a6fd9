"""`python -m specfire.parallel.worker FD PARENT_PID`: one local rank of a mesh started by rank 0."""
from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection


def main() -> int:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    from .mesh import worker_main

    return worker_main(Connection(fd), parent_pid)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown of torch's threads; everything is already freed
