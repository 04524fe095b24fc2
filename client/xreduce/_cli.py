"""The ``xreduce`` command: tools around the daemon.

``xreduce plan`` prints the plan the daemon would run, step by step.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

import numpy as np

_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """Parses a size such as ``1MiB``, ``4096`` or ``2 GB``.

    Example:
        >>> parse_bytes("1MiB"), parse_bytes("4KiB")
        (1048576, 4096)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64KiB, 1MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _plan(args: argparse.Namespace) -> int:
    from xreduced import planner  # the planner ships in the same distribution

    dtype = np.dtype(args.dtype)
    if args.bytes % dtype.itemsize:
        print(f"xreduce plan: --bytes {args.bytes} is not a multiple of {dtype.name}'s "
              f"{dtype.itemsize} bytes", file=sys.stderr)
        return 2
    elements = [args.bytes // dtype.itemsize] * args.tensors
    devices = range(args.devices)
    if args.algorithm == "hierarchical_copy":
        plan = planner.hierarchical_copy(devices, elements, dtype.itemsize, args.num_packs)
    else:
        plan = planner.reduction_to_one_device(devices, devices, elements, dtype.itemsize)
    print(planner.describe(plan))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xreduce`` command.

    Example (shell):
        $ xreduce plan --devices 8 --num-packs 2 --bytes 1MiB
    """
    p = argparse.ArgumentParser(prog="xreduce", description="xreduce tools")
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the reduction plan for a value, step by step")
    plan.add_argument("--devices", type=int, default=8, help="number of devices (default 8)")
    plan.add_argument("--num-packs", type=int, default=1, help="TF's num_packs (default 1; 0: no packing)")
    plan.add_argument("--bytes", type=parse_bytes, default=parse_bytes("1MiB"),
                      help="bytes of each tensor per device (default 1MiB)")
    plan.add_argument("--tensors", type=int, default=1, help="tensors in the batch (default 1)")
    plan.add_argument("--dtype", default="float32", help="element type (default float32)")
    plan.add_argument("--algorithm", default="hierarchical_copy",
                      choices=["hierarchical_copy", "reduction_to_one_device"])
    args = p.parse_args(argv)
    for name in ("devices", "tensors"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.num_packs < 0:
        p.error(f"--num-packs must be >= 0; got {args.num_packs}")
    try:
        np.dtype(args.dtype)
    except TypeError:
        p.error(f"--dtype: unknown dtype {args.dtype!r}")
    return _plan(args)


if __name__ == "__main__":
    raise SystemExit(main())
