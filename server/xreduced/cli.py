"""The ``xreduced`` command: parse, configure logging, serve until a signal."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence

from xreduced import config as config_lib
from xreduced import memory
from xreduced.server import Daemon


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the daemon until SIGINT or SIGTERM; returns the exit status.

    Example (shell):
        $ xreduced --listen 127.0.0.1:0 --virtual-devices 4
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = config_lib.check(config_lib.resolve(argv))
    except ValueError as e:
        print(f"xreduced: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    # Before the serving threads exist: with glibc's defaults each of them gets an arena that keeps what it
    # freed, and the daemon's memory would not stay within --max-inflight-bytes (memory.py).
    tuned = memory.tune_malloc()
    logging.getLogger("xreduced").debug("event=malloc tuned=%s arenas=%d mmap_threshold=%d", tuned,
                                        memory.MALLOC_ARENAS, memory.MALLOC_MMAP_THRESHOLD)
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
    return 0
