"""The big-tensors benchmark of ``xreduce bench --big-tensors``, as a script.

Every option of ``xreduce bench --big-tensors`` works here (``--help`` lists
them); the implementation is the ``xreduce_bench`` package
(``xreduce_bench.big``). The issue's sweep, 64 MiB to 4 GiB per replica, 2
and 4 processes, against gloo:

    python bench/big_tensors.py --sizes 64MiB,256MiB,1GiB,4GiB --processes 2,4 --peers gloo \\
        --json bench/results/big-tensors.json --plot bench/results/big-tensors.png
"""

import sys

from xreduce_bench.command import main

if __name__ == "__main__":
    sys.exit(main(["--big-tensors", *sys.argv[1:]], prog="big_tensors.py"))
