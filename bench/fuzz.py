"""Malformed requests against a fresh daemon, about 10,000 of them: no crash, no hang, only client-error codes.

What is sent and how it is judged: ``xreduce_bench.fuzzing``, which the tests share.

Usage:
    .venv/bin/python bench/fuzz.py [--messages 5600] [--streams 1500] [--churn 150] [--raw 2000] [--seed 0]
"""

import sys

from xreduce_bench.fuzzing import main

if __name__ == "__main__":
    sys.exit(main())
