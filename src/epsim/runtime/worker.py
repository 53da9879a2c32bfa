"""``python -m epsim.runtime.worker FOLDER RANK``: one rank spawned by ``epsim.runtime.launch.launch_local``."""

import sys

from epsim.runtime.launch import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], int(sys.argv[2])))
