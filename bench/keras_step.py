"""A Keras training step through the daemon against TensorFlow's own, in the same run: ratios of step times.

Two comparisons, each on an MLP of 82,689 parameters and one of about 1.07 M, global batch 64, SGD with momentum,
``--rounds`` times, each round's jobs fresh processes:

* ``one process``: one process, 2 logical CPUs: ``tf.distribute.MirroredStrategy`` with
  ``xreduce.tensorflow.HierarchicalCopyAllReduce`` against TF's own ``HierarchicalCopyAllReduce`` (target <= 1.1x),
  both in the same process (the same model fitted under each strategy, timed in turn ``--alternations`` times):
  this machine's step times change from process to process (about 2, 4 or 7 ms for the same job), and a peer in
  the same process sees the same;
* ``two processes``: 2 processes x 1 replica: ``xreduce.tensorflow.MirroredStrategy`` on one daemon against TF's
  ``MultiWorkerMirroredStrategy`` (RING) between the same two (target <= 0.5x), xreduce's job then the peer's.

A step's time three ways: the median step (of the long epoch's steps, each from one step's end to the next's as
Keras' callbacks see them: what this machine's noise moves least, and what the table's ratio is of); the steady
one, the slope of an epoch's wall time between an epoch of ``--steps`` steps and one of a quarter of them, after a
first (tracing) epoch, so that an epoch's own start and end (the iterator, the metrics' reductions) are left out
(a difference of two noisy times: it can even come out negative); and the mean over the long epoch, which includes
them. For xreduce,
where a step's time goes: in the bridge
(the Python function the traced step calls: numpy in, the SDK call, results out), in the SDK's call (transport and
daemon), and in the daemon's reduction (its ``xreduce_reduction_seconds`` of BatchReduce); a step that takes
xreduce's TF kernel has no Python to time: the kernel's own parts instead (copying in, the exchange with the daemon,
copying out; ``xreduce.tensorflow._kernel.times``).

The one-process comparison's turns alternate in order (xreduce first, then the peer first: ABBA). Its verdict is
pooled over every pair of the run: the median of the pairs' ratios of median steps, with a 95% interval from a
bootstrap that draws whole rounds (a round is a process, and this machine's speed changes from process to process,
so a round's pairs are not independent). ``--json`` keeps the pairs; ``--pool`` pools the pairs of several runs'
files the same way, without running anything: ``--json`` files, or what the bench printed (each
``# bench/keras_step.py`` header starts a run; its one-process rounds are read back from their lines).

    python bench/keras_step.py --rounds 3 > bench/results/keras-step.txt
    python bench/keras_step.py --rounds 6 --alternations 4 --models mlp1m --comparisons 1 --json run1.json
    python bench/keras_step.py --pool run1.json run2.json bench/results/keras-step-one-process-phases.txt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import urllib.request

from xreduce_bench.daemon import DaemonProcess
from xreduce_bench.keras_job import KERNEL_PARTS

TIMES = ("steady_step_seconds", "seconds_per_step", "median_step_seconds")
"""A job's times of a step, as printed: steady, epoch mean, median."""


def _ms(times: tuple[float, ...]) -> str:
    return " / ".join(f"{t * 1e3:6.2f}" for t in times)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(argvs: list[list[str]], env: dict[str, str], timeout: float, rounds: list | None = None) -> list[dict]:
    """Each process's ``fit`` event; its ``round`` events go to ``rounds``."""
    procs = [subprocess.Popen([sys.executable, "-m", "xreduce_bench.keras_job", *argv], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv in argvs]
    ended = [p.communicate(timeout=timeout) for p in procs]
    out = []
    for k, (stdout, stderr) in enumerate(ended):
        events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        if rounds is not None:
            rounds += [e for e in events if e["event"] == "round"]
        last = events[-1] if events else {"event": "none"}
        if last["event"] != "fit":  # a crash's own stack is at the start (PYTHONFAULTHANDLER), others' at the end
            last = dict(last, status=procs[k].returncode, stderr=stderr[:4000] + "\n...\n" + stderr[-2000:])
        out.append(last)
    if any(e["event"] != "fit" for e in out):
        raise RuntimeError(f"a job failed: {out}")
    return out


def reduction_seconds(metrics: str) -> tuple[float, float]:
    """(sum, count) of the daemon's BatchReduce reductions so far."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("xreduce_reduction_seconds_") and "BatchReduce" in line:
            name, value = line.rsplit(" ", 1)
            found[name.split("{")[0].rsplit("_", 1)[-1]] = float(value)
    return found.get("sum", 0.0), found.get("count", 0.0)


COMPARISONS = ("one process, 2 replicas", "two processes x 1 replica")

TARGETS = {COMPARISONS[0]: 1.1, COMPARISONS[1]: 0.5}
"""Each comparison's target: xreduce's median step over the peer's at most this."""

BOOTSTRAP_DRAWS = 4000
"""Draws of the bootstrap behind a pooled ratio's interval (:func:`pooled`)."""


def pooled(rounds: dict[object, list[float]], draws: int = BOOTSTRAP_DRAWS,
           seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median of every pair's ratio, and a 95% interval for it from a bootstrap that draws
    whole rounds with replacement (``rounds``: each round's pairs' ratios), seeded so that a run's line is
    reproducible from its pairs.

    Example:
        >>> pooled({0: [1.0, 1.1], 1: [1.2]}, draws=200)[0]
        1.1
    """
    every = [r for ratios in rounds.values() for r in ratios]
    groups = [ratios for ratios in rounds.values() if ratios]
    rng = random.Random(seed)
    medians = sorted(statistics.median([r for g in rng.choices(groups, k=len(groups)) for r in g])
                     for _ in range(draws))
    return statistics.median(every), medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


ROUND_LINE = re.compile(r"(\S+) +(one process, 2 replicas) +round (\d+)\.(\d+): xreduce +([-0-9.]+) / +([-0-9.]+) / "
                        r"+([-0-9.]+) ms, peer +([-0-9.]+) / +([-0-9.]+) / +([-0-9.]+) ms")
"""A one-process round's line as the bench prints it: model, comparison, round, turn, then the six times."""


def read_pairs(path: str, run: int) -> tuple[list[dict], int]:
    r"""The pairs a ``--json`` file keeps, or those a printed run's lines give (runs numbered from ``run``, each
    ``# bench/keras_step.py`` header a new one); and the next run's number.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        ...     _ = f.write("# bench/keras_step.py: ...\nmlp1m  one process, 2 replicas    round 1.2: xreduce   1.00 / "
        ...                 "  2.00 /   3.00 ms, peer   1.00 /   2.00 /   2.50 ms, ratio ...\n")
        >>> pairs, after = read_pairs(f.name, 4)
        >>> pairs[0]["run"], pairs[0]["round"], pairs[0]["mine"][2] / pairs[0]["peer"][2], after
        (4, 1, 1.2, 5)
        >>> os.unlink(f.name)
    """
    with open(path) as f:
        text = f.read()
    with contextlib.suppress(json.JSONDecodeError):
        return [dict(pair, run=run) for pair in json.loads(text)["pairs"]], run + 1
    pairs, at = [], run - 1
    for line in text.splitlines():
        if line.startswith("# bench/keras_step.py"):
            at += 1
        elif (m := ROUND_LINE.match(line)) is not None:
            times = [float(t) for t in m.groups()[4:]]
            pairs.append({"model": m[1], "comparison": m[2], "run": max(at, run), "round": int(m[3]),
                          "turn": int(m[4]), "mine": times[:3], "peer": times[3:]})
    return pairs, max(at, run) + 1


def pooled_line(pairs: list[dict]) -> list[str]:
    """A line for each model and comparison among ``pairs`` (as ``--json`` keeps them): how many pairs and rounds,
    the median ratio of median steps and its interval (:func:`pooled`), and how many pairs were over the target.

    Example:
        >>> pair = {"model": "mlp", "comparison": COMPARISONS[0], "round": 0, "mine": [0, 0, 1.2], "peer": [0, 0, 1.0]}
        >>> line = pooled_line([pair])[0]
        >>> line.split(", median")[0], "steps 1.200 (95% interval over rounds 1.200-1.200)" in line
        ('pooled: mlp one process, 2 replicas: 1 pairs in 1 rounds', True)
        >>> line.split("; ")[1]
        '1 pair(s) over the target 1.1'
    """
    lines = []
    for key in dict.fromkeys((p["model"], p["comparison"]) for p in pairs):
        chosen = [p for p in pairs if (p["model"], p["comparison"]) == key]
        rounds: dict[object, list[float]] = {}
        for p in chosen:
            rounds.setdefault((p.get("run", 0), p["round"]), []).append(p["mine"][2] / p["peer"][2])
        median, low, high = pooled(rounds)
        target = TARGETS[key[1]]
        over = sum(r > target for ratios in rounds.values() for r in ratios)
        lines.append(f"pooled: {key[0]} {key[1]}: {len(chosen)} pairs in {len(rounds)} rounds, median ratio of "
                     f"median steps {median:.3f} (95% interval over rounds {low:.3f}-{high:.3f}); {over} pair(s) "
                     f"over the target {target}")
    return lines


def ours(name: str, common: list[str], alternations: int = 0) -> list[list[str]]:
    """The xreduce job of comparison ``name``: each process's arguments (the first's with TF's own strategy in the
    same process, timed in turn ``alternations`` times)."""
    if name == COMPARISONS[0]:
        return [["--strategy", "xreduce-ops", "--replicas", "2", "--profile", "--alternate-with", "tf-hcar",
                 "--alternations", str(alternations), *common]]
    return [["--strategy", "xreduce", "--replicas", "1", "--processes", "2", "--process-id", str(k), "--profile",
             *common] for k in range(2)]


def peer(name: str, common: list[str], ports: str) -> list[list[str]]:
    """TF's job of comparison ``name``: each process's arguments (MWMS workers at ``ports``)."""
    if name == COMPARISONS[0]:
        return [["--strategy", "tf-hcar", "--replicas", "2", *common]]
    return [["--strategy", "mwms", "--processes", "2", "--process-id", str(k), "--mwms-ports", ports, *common]
            for k in range(2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200, help="steps of the timed epoch")
    p.add_argument("--models", default="mlp,mlp1m")
    p.add_argument("--comparisons", default="1,2", help="1: one process against TF's own; 2: two against MWMS")
    p.add_argument("--alternations", type=int, default=3,
                   help="comparison 1: xreduce and TF's own timed in turn this many times in each round's process")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default="", help="write every pair of step times (and its round) to this file")
    p.add_argument("--pool", nargs="+", default=None, metavar="FILE",
                   help="run nothing: pool the pairs of these --json files (each file a run) and print the lines")
    p.add_argument("--no-kernel", action="store_true",
                   help="XREDUCE_TF_KERNEL=0: the steps (one process's, a group's) take the tf.numpy_function "
                        "bridge, not xreduce's TF kernel")
    args = p.parse_args()
    if args.pool:
        every, run = [], 0
        for path in args.pool:
            pairs, run = read_pairs(path, run)
            every += pairs
        print("\n".join(pooled_line(every)))
        return 0
    # PYTHONFAULTHANDLER: a process that dies of a signal (TF's SIGSEGV between fits, docs/benchmarks.md) prints where.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", XREDUCE_STALL_WARNING_SECONDS="0", PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    if args.no_kernel:
        env["XREDUCE_TF_KERNEL"] = "0"
    metrics = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="xreduce-keras-") as tmp:
        daemon = DaemonProcess(["--listen", f"unix:{tmp}/xreduced.sock", "--metrics-listen", metrics,
                                "--log-level", "WARNING"])
        env["XREDUCE_ADDRESS"] = daemon.address
        try:
            print(f"# bench/keras_step.py: {args.rounds} rounds, {args.steps} timed steps a job, global batch 64; "
                  "milliseconds per step (steady / epoch mean / median step)")
            rows = []
            kept: list[dict] = []
            failures = 0
            for model in args.models.split(","):
                common = ["--model", model, "--steps", str(args.steps), "--timed-epochs", "1"]
                for name in [COMPARISONS[int(c) - 1] for c in args.comparisons.split(",")]:
                    mine, theirs, profile = [], [], []
                    for r in range(args.rounds):
                        env["XREDUCE_GROUP"] = f"bench-{model}-{r}-{len(name)}"
                        before = reduction_seconds(metrics)
                        try:
                            if name == COMPARISONS[0]:  # the peer in the same process, timed in turn
                                rounds: list[dict] = []
                                job(ours(name, common, args.alternations), env, args.timeout, rounds)
                                fits = rounds
                            else:
                                fits = job(ours(name, common), env, args.timeout)
                            after = reduction_seconds(metrics)
                            if name == COMPARISONS[0]:
                                pairs = [(tuple(f[k] for k in TIMES), tuple(f["peer_" + k] for k in TIMES))
                                         for f in fits]
                            else:
                                peers = job(peer(name, common, f"{free_port()},{free_port()}"), env, args.timeout)
                                pairs = [(tuple(max(f[k] for f in fits) for k in TIMES),
                                          tuple(max(f[k] for f in peers) for k in TIMES))]
                        except RuntimeError as e:  # a job that crashed: said, and the run goes on
                            print(f"{model:6s} {name:26s} round {r}: {e}", flush=True)
                            failures += 1
                            continue
                        daemon_s = (after[0] - before[0]) / max(after[1] - before[1], 1)
                        for k, (m, t) in enumerate(pairs):
                            mine.append(m)
                            theirs.append(t)
                            kept.append({"model": model, "comparison": name, "round": r, "turn": k,
                                         "first": fits[k].get("first", "xreduce"), "mine": list(m), "peer": list(t)})
                            profile.append((statistics.mean(f["bridge_seconds_per_step"] for f in fits),
                                            statistics.mean(f["sdk_seconds_per_step"] for f in fits), daemon_s))
                            label = f"round {r}" + (f".{k}" if len(pairs) > 1 else "")
                            kernel = [statistics.mean(f[part] or 0.0 for f in fits) * 1e3 for part in KERNEL_PARTS]
                            where = []
                            if any(kernel):
                                where.append("xreduce's TF kernel: copy in {:.2f} ms, exchange {:.2f} ms, copy out "
                                             "{:.2f} ms".format(*kernel))
                            if profile[-1][0]:
                                where.append(f"bridge {profile[-1][0] * 1e3:.2f} ms, SDK call "
                                             f"{profile[-1][1] * 1e3:.2f} ms")
                            print(f"{model:6s} {name:26s} {label}: xreduce {_ms(mine[-1])} ms, peer "
                                  f"{_ms(theirs[-1])} ms, ratio "
                                  f"{' / '.join(f'{a / b:.2f}' for a, b in zip(mine[-1], theirs[-1]))} "
                                  f"({'; '.join(where) or 'no call timed'}, "
                                  f"daemon's reduction {profile[-1][2] * 1e3:.2f} ms)", flush=True)
                    if not mine:
                        continue
                    ratios = [statistics.median(m[i] / t[i] for m, t in zip(mine, theirs)) for i in range(3)]
                    rows.append((model, name, statistics.median(m[2] for m in mine),
                                 statistics.median(t[2] for t in theirs), *ratios))
            print("\n| model | comparison | xreduce (median step) | peer | ratio of median steps | of steady steps | "
                  "of epoch means |")
            print("|---|---|---|---|---|---|---|")
            for model, name, mine_s, theirs_s, steady, mean, median in rows:
                other = "TF's HierarchicalCopyAllReduce" if name == COMPARISONS[0] else "MultiWorkerMirroredStrategy"
                print(f"| {model} | {name} vs {other} | {mine_s * 1e3:.2f} ms | {theirs_s * 1e3:.2f} ms | "
                      f"{median:.2f} | {steady:.2f} | {mean:.2f} |")
            if kept:
                print()
                print("\n".join(pooled_line(kept)))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"argv": sys.argv[1:], "pairs": kept}, f, indent=1)
            if failures:
                print(f"\n{failures} round(s) failed (above); the table leaves them out")
        finally:
            daemon.terminate()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
