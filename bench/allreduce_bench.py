"""The all-reduce sweep of ``xreduce bench``, runnable from a checkout without installing.

Every option of ``xreduce bench`` works here (``--help`` lists them); the
implementation is ``client/xreduce/_bench.py`` and the ``_bench_*.py`` modules
beside it. For instance, the issue's targets in one run (4 processes, shared
memory and the wire, gloo, Open MPI):

    python bench/allreduce_bench.py --embedded --processes 4 --transport shm,wire \\
        --max-bytes 64MiB --iters 10 --peers --plot allreduce.png
    python bench/allreduce_bench.py --embedded --processes 2 --max-bytes 4KiB --transport wire,shm --echo
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _sub in ("server", "client"):  # runnable from a checkout without installing
    if str(_ROOT / _sub) not in sys.path:
        sys.path.insert(0, str(_ROOT / _sub))

from xreduce._cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
