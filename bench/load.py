"""Many concurrent clients against one daemon: every answer right, memory bounded by the in-flight limit.

What the clients send and how it is checked: ``xreduce_bench.load``, which the tests share.

Usage:
    .venv/bin/python bench/load.py [--clients 32] [--calls 500] [--max-inflight-mib 256]
"""

import sys

from xreduce_bench.load import main

if __name__ == "__main__":
    sys.exit(main())
