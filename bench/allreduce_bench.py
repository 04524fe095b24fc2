"""The all-reduce sweep of ``xreduce bench``, as a script.

Every option of ``xreduce bench`` works here (``--help`` lists them); the
implementation is the ``xreduce_bench`` package (``xreduce_bench.command``).
For instance, the issue's targets in one run (4 processes, shared memory and
the wire, gloo, Open MPI):

    python bench/allreduce_bench.py --embedded --processes 4 --transport shm,wire \\
        --max-bytes 64MiB --iters 10 --peers --plot allreduce.png
    python bench/allreduce_bench.py --embedded --processes 2 --max-bytes 4KiB --transport wire,shm --echo
"""

import sys

from xreduce_bench.command import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
