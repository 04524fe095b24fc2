"""The multi-node all-reduce benchmark (``xreduce bench --nodes``), as a script; needs root.

The nodes are network namespaces on one bridge, made and removed by the run;
every option of ``xreduce bench --nodes`` works here (``--help`` lists them;
``--nodes`` defaults to 2).
For instance, the scaling from one node to three, unshaped and over 1 Gbit/s
links, 4 processes per node, 64 MiB each:

    sudo python bench/multinode_bench.py --nodes 1,2,3 --procs-per-node 4 --size 64MiB \\
        --shape none,1gbit --iters 3 --warmup 1 --json bench/results/multinode.json
"""

import sys

from xreduce_bench.command import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    named = any(a.split("=")[0] in ("--nodes", "-h", "--help") for a in argv)
    sys.exit(main(argv if named else ["--nodes", "2", *argv], prog="multinode_bench.py"))
