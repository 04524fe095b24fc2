"""The ``xreduced`` command: parse, configure logging, serve until a signal.

``xreduced plan`` prints the plan the daemon would run for a value, step by
step, and exits (``xreduce plan`` runs it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
from xreduce.wire.codec import SUPPORTED_DTYPES

from xreduced import config as config_lib
from xreduced import memory, oom, planner
from xreduced.config import parse_bytes
from xreduced.server import Daemon


def main(argv: Sequence[str] | None = None, plan_prog: str = "xreduced plan") -> int:
    """Runs the daemon until SIGINT or SIGTERM, or with ``plan`` first prints a plan; returns the exit status.

    ``plan_prog`` is the command its usage names (``xreduce plan`` runs it too).

    Example (shell):
        $ xreduced --listen 127.0.0.1:0 --virtual-devices 4
        $ xreduced plan --devices 8 --num-packs 2 --bytes 1MiB
    """
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:1]) == ["plan"]:
        try:
            status = plan(argv[1:], plan_prog)
            sys.stdout.flush()  # here, not at exit: a reader that went away (`| head`) shows up inside the try
            return status
        except BrokenPipeError:
            return _reader_gone()
    return serve(argv)


def _reader_gone() -> int:
    """Quiets stdout after its reader went away; returns the status of a process killed by SIGPIPE.

    Python ignores SIGPIPE, so a write to a closed pipe raises ``BrokenPipeError``
    where a C tool would end silently; the interpreter would raise it once more
    when it flushes stdout at exit, unless stdout points at ``/dev/null``.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
"""The daemon's log lines: time, level, logger, then ``event=... key=value ...``."""


class LineFormatter(logging.Formatter):
    """:data:`LOG_FORMAT`'s formatter, whose time is the default's to the character, its date and clock part
    made once a second instead of once a line (every call writes a line).

    Example:
        >>> record = logging.makeLogRecord({"msg": "event=x", "levelname": "INFO", "name": "xreduced",
        ...                                 "created": 1700000000.25, "msecs": 250.0})
        >>> LineFormatter(LOG_FORMAT).format(record) == logging.Formatter(LOG_FORMAT).format(record)
        True
    """

    _second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None or self.default_msec_format is None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        cached = self._second
        if cached[0] != second:
            cached = self._second = (second, time.strftime(self.default_time_format, self.converter(record.created)))
        return self.default_msec_format % (cached[1], record.msecs)


def configure_logging(level: str, stream) -> None:
    """The daemon's logging, in its own process: :data:`LOG_FORMAT` at ``level`` to ``stream``.

    Every call writes a log line (``event=call``), and the format names no source line, thread or
    process, so records skip looking them up (the logging HOWTO's "Optimization"), and the time's date
    part is made once a second (:class:`LineFormatter`).

    Example (in the daemon's own process: it sets the logging module's globals):
        configure_logging("INFO", sys.stderr)
    """
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LineFormatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False


def serve(argv: Sequence[str]) -> int:
    """Runs the daemon configured by ``argv`` (flags, then ``XREDUCE_*``) until SIGINT or SIGTERM.

    Returns:
        0 after a signal, 1 when the daemon could not start, 2 for bad settings.

    Example (shell):
        $ xreduced --listen unix:/run/xreduced.sock --backend numpy
    """
    try:
        config = config_lib.check(config_lib.resolve(argv))
    except ValueError as e:
        print(f"xreduced: {e}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, sys.stderr)
    # Before the serving threads exist: with glibc's defaults each of them gets an arena that keeps what it
    # freed, and the daemon's memory would not stay within --max-inflight-bytes (memory.py).
    tuned = memory.tune_malloc()
    logging.getLogger("xreduced").debug("event=malloc tuned=%s arenas=%d mmap_threshold=%d", tuned,
                                        memory.MALLOC_ARENAS, memory.MALLOC_MMAP_THRESHOLD)
    # The daemon maps every client's shared memory, so it can look like the node's largest process: the
    # kernel should pick a training process first (oom.py).
    in_effect = oom.set_score_adj(config.oom_score_adj)
    logging.getLogger("xreduced").debug("event=oom_score_adj in_effect=%s", in_effect)
    stop = threading.Event()

    def on_signal(signum, _frame):
        logging.getLogger("xreduced").info("event=signal signal=%s", signal.Signals(signum).name)
        stop.set()

    # Handlers go in before the daemon says it serves: a signal sent then must stop it gracefully.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    log = logging.getLogger("xreduced")
    try:
        daemon = Daemon(config).start()
    except RuntimeError as e:
        log.error("event=start_failed error=%r", str(e))
        return 1
    if not log.isEnabledFor(logging.INFO):
        # Logged at any level: it is how a caller learns the bound address.
        log.log(logging.getLevelName(config.log_level), "%s", daemon.serving_line())
    while not stop.wait(0.5):
        pass
    daemon.stop()
    if "torch" in sys.modules:
        # A group across nodes loaded torch: its Gloo threads can abort the interpreter's teardown
        # ("terminate called without an active exception"), so the exit status would lie. Everything is
        # stopped and flushed by now: leave without the teardown.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(0)
    return 0


def wire_dtype(text: str) -> np.dtype:
    """Parses a dtype the daemon reduces: one of ``SUPPORTED_DTYPES``, or numpy's name for one (``f4``).

    Raises:
        argparse.ArgumentTypeError: any other dtype (strings, objects, bool...) or
            no dtype at all; the message repeats it and lists the accepted ones.

    Example:
        >>> wire_dtype("f4").name, wire_dtype("bfloat16").itemsize
        ('float32', 2)
    """
    try:
        dtype = np.dtype(text)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in SUPPORTED_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype the daemon reduces; use one of "
                                         f"{', '.join(SUPPORTED_DTYPES)}")
    return dtype


def plan_parser(prog: str = "xreduced plan") -> argparse.ArgumentParser:
    """The ``xreduced plan`` argument parser; ``prog`` is the command its usage names.

    Example:
        >>> plan_parser().parse_args(["--bytes", "4KiB"]).bytes
        4096
    """
    p = argparse.ArgumentParser(prog=prog,
                                description="Prints the reduction plan the daemon would run for a value, step by step.")
    p.add_argument("--devices", type=int, default=8, help="number of devices (default 8)")
    p.add_argument("--num-packs", type=int, default=1, help="TF's num_packs (default 1; 0: no packing)")
    p.add_argument("--bytes", type=parse_bytes, default=parse_bytes("1MiB"),
                   help="bytes of each tensor per device (default 1MiB)")
    p.add_argument("--tensors", type=int, default=1, help="tensors in the batch (default 1)")
    p.add_argument("--dtype", type=wire_dtype, default="float32",
                   help=f"element type, one of {', '.join(SUPPORTED_DTYPES)} (default float32)")
    p.add_argument("--algorithm", default="hierarchical_copy", choices=["hierarchical_copy", "reduction_to_one_device"],
                   help="hierarchical_copy (TF's HierarchicalCopyAllReduce: each pack summed within each half of the "
                   "devices, then across the halves) or reduction_to_one_device (TF's ReductionToOneDevice: summed on "
                   "the first device, then copied back); default hierarchical_copy")
    return p


def plan(argv: Sequence[str], prog: str = "xreduced plan") -> int:
    """``xreduced plan``: prints the plan for ``--tensors`` tensors of ``--bytes`` on each of ``--devices``;
    ``prog`` is the command the usage and the messages name.

    Returns:
        0, or 2 for arguments that make no plan (argparse exits with 2 for malformed ones).

    Example:
        >>> plan(["--devices", "2", "--bytes", "8"])
        hierarchical_copy over 2 devices [0, 1], 1 pack(s), 8 B per device
        pack 0 (2 elements, 8 B): main devices 0 and 1
          copy in@1: 1 -> 0 (8 B)
          sum on 0: in@0 + in@1 -> total
          copy total: 0 -> 1 (8 B)
        total copied: 16 B
        0
    """
    p = plan_parser(prog)
    args = p.parse_args(list(argv))
    for name in ("devices", "tensors"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.num_packs < 0:
        p.error(f"--num-packs must be >= 0; got {args.num_packs}")
    dtype = args.dtype
    if args.bytes % dtype.itemsize:
        print(f"{prog}: --bytes {args.bytes} is not a multiple of {dtype.name}'s "
              f"{dtype.itemsize} bytes", file=sys.stderr)
        return 2
    elements = [args.bytes // dtype.itemsize] * args.tensors
    devices = range(args.devices)
    if args.algorithm == "hierarchical_copy":
        steps = planner.hierarchical_copy(devices, elements, dtype.itemsize, args.num_packs)
    else:
        steps = planner.reduction_to_one_device(devices, devices, elements, dtype.itemsize)
    print(planner.describe(steps))
    return 0
