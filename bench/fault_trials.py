"""Randomized faults in the middle of collectives across nodes: what the survivors see, and what the
surviving daemon keeps.

Two node daemons and four training processes (two per node, two devices each; process 0's node is the
coordinator's and survives). In each trial the processes join, then run back-to-back collectives of
mostly large tensors; at a random point of them node 1 is hit:

* ``kill``: node 1's daemon is SIGKILLed (then restarted on its port);
* ``stop``: node 1's daemon is SIGSTOPped (then SIGKILLed and restarted);
* ``link-down`` (root, network namespaces): node 1's switch port goes down, its packets dropped
  silently (then it comes back up);
* ``link-flap`` (root, network namespaces): node 1's switch port goes down and up again
  :data:`FLAPS` times, each time down for 0.2 to 3 s (below and above the peer timeout) and up for 0.1
  to 0.5 s, and stays up;
* ``process-kill``: process 3, a training process of node 1, is SIGKILLed (its daemon lives on: it sees the
  process's session end); a new process 3 takes its place for the rejoin.

The trials of a mode are one job restarting: the same coordinator address throughout. Per trial: when
node 0's processes failed after the fault (detection), with which codes; whether anything partial was
received (a result with wrong bytes, or a collective that completed for one process and failed for
another); whether node 0's daemon then served a single-process reduce; whether every process, after
``shutdown()`` and ``initialize()``, formed a new epoch that reduced correctly. Node 0's daemon's
threads, open descriptors and resident memory (``/proc``) are read after a warm-up trial and after all
trials; and, at the end, over jobs that each have a coordinator address of their own
(``--distinct-jobs``).

Usage (a few minutes; the machine otherwise idle):

    .venv/bin/python bench/fault_trials.py [--trials 20] [--modes kill,stop,process-kill,link-down,link-flap]
        [--json bench/results/fault-trials.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import random
import signal
import statistics
import sys
import threading
import time

import numpy as np
from xreduce_bench.faults import Cluster, NamespaceCluster, NodeProcess, footprint

FLAPS = 3
"""How many times the ``link-flap`` mode takes the link down."""
LINK_MODES = ("link-down", "link-flap")
"""The modes that cut a link between network namespaces (root)."""
PLACEMENT = [0, 0, 1, 1]
DEVICES = 4
SIZES_MIB = (0.004, 4, 16, 32, 64)
WEIGHTS = (1, 1, 2, 2, 2)
"""The collectives' sizes (MiB a replica) and how often each is drawn: mostly large."""
COLLECTIVES = 6
FILL = float(sum(range(1, len(PLACEMENT) * DEVICES // 2 + 1)))
"""Replica r holds r + 1 everywhere: every element of every sum is 1 + 2 + ... + 8."""


def _small(name: str) -> dict:
    return {"op": "reduce", "name": name, "fill": "index", "tensors": [{"dtype": "float32", "shape": [4]}]}


def script(elements: list[int]) -> list[dict]:
    """Join, warm up, wait; the collectives; wait; join again and reduce once."""
    big = [{"op": "reduce", "fill": "index", "digest": True, "tensors": [{"dtype": "float32", "shape": [n]}]}
           for n in elements]
    return [{"op": "init"}, _small("warm"), {"op": "barrier"}, *big, {"op": "barrier"}, {"op": "shutdown"},
            {"op": "init"}, _small("again")]


def _digest(elements: int, cache: dict[int, str] = {}) -> str:  # noqa: B006 (a cache on purpose)
    if elements not in cache:
        cache[elements] = hashlib.sha256(np.full(elements, FILL, np.float32).tobytes()).hexdigest()
    return cache[elements]


def _daemon_serves(cluster) -> bool:
    """Whether node 0's daemon serves a single-process reduce (from a process on node 0)."""
    (process,) = cluster.launch([0], [{"op": "local"}])
    try:
        (event,) = process.steps(120)
    finally:
        process.close()
    want = np.full(3, DEVICES * (DEVICES + 1) / 2, np.float32).tobytes()
    return event["ok"] and all(bytes.fromhex(c["hex"]) == want for c in event["result"])


class Trials:
    """One mode's cluster and its trials."""

    def __init__(self, mode: str, cluster, rng: random.Random, args: argparse.Namespace, nodes=None):
        self.mode, self.cluster, self.rng, self.args, self.nodes = mode, cluster, rng, args, nodes
        self.span = 2.0
        """Seconds the collectives take, about (the calibration sets it): the faults land within it."""
        self._flapping: threading.Thread | None = None
        """The ``link-flap`` mode's flaps, in the background (:meth:`recover` waits for them)."""

    KILLED = len(PLACEMENT) - 1
    """The process the ``process-kill`` mode kills: the last, on node 1."""

    def fault(self, processes: list) -> None:
        if self.mode == "process-kill":
            processes[self.KILLED].signal(signal.SIGKILL)
        elif self.mode == "kill":
            self.cluster.daemons[1].proc.send_signal(signal.SIGKILL)
        elif self.mode == "stop":
            self.cluster.daemons[1].proc.send_signal(signal.SIGSTOP)
        elif self.mode == "link-flap":
            pattern = [(self.rng.uniform(0.2, 3.0), self.rng.uniform(0.1, 0.5)) for _ in range(FLAPS)]
            self._flapping = threading.Thread(target=self._flap, args=(pattern,), daemon=True)
            self._flapping.start()
        else:
            self.nodes.cut(self.nodes[2])

    def _flap(self, pattern: list[tuple[float, float]]) -> None:
        for down, up in pattern:
            self.nodes.cut(self.nodes[2])
            time.sleep(down)
            self.nodes.restore(self.nodes[2])
            time.sleep(up)

    def recover(self, processes: list, steps: list[dict], rejoin: int) -> None:
        if self.mode == "process-kill":  # a new process in the killed one's place, from the rejoin on
            p = self.KILLED
            processes[p].close()
            processes[p] = NodeProcess(self.cluster.address(PLACEMENT[p]), self.cluster.coordinator, len(PLACEMENT),
                                       p, steps[rejoin:])
        elif self.mode == "link-down":
            self.nodes.restore(self.nodes[2])
        elif self.mode == "link-flap":
            self._flapping.join()  # it ends with the link up
        else:
            self.cluster.restart(1)

    def run(self, number: int, fault: bool = True) -> dict:
        """One trial (``fault=False``: the calibration, every collective must complete)."""
        elements = [max(1, int(self.rng.choices(SIZES_MIB, WEIGHTS)[0] * (1 << 20) / 4)) for _ in range(COLLECTIVES)]
        steps = script(elements)
        first, after = 3, 3 + COLLECTIVES
        processes = self.cluster.launch(PLACEMENT, steps)
        record: dict = {"trial": number, "mode": self.mode if fault else "none",
                        "sizes_mib": [round(n * 4 / (1 << 20), 3) for n in elements]}
        try:
            for p in processes:
                e = p.step(1, 180)
                if not e["ok"]:
                    raise RuntimeError(f"the warm-up failed: {e['code']}: {e['message']}")
            epoch = processes[0].step(0)["result"]["epoch"]
            for p in processes:
                p.go()
            start = max(p.calling(first)["t"] for p in processes)
            since = None
            if fault:
                time.sleep(self.rng.uniform(0, 0.8 * self.span))
                since = time.monotonic()
                self.fault(processes)
                record["fault_after_s"] = round(since - start, 3)
            survivors = [p for p, node in zip(processes, PLACEMENT) if node == 0]
            bound = self.args.collective_timeout + 30
            if fault:
                record.update(self._detection({p.process_id: [p.step(i, bound) for i in range(first, after)]
                                               for p in survivors}, since))
            record["survivor_served"] = _daemon_serves(self.cluster)
            rejoin = after + 2  # the script's second init
            if fault:
                self.recover(processes, steps, rejoin)
            t = time.monotonic()
            for p in processes:
                p.go()
            replaced = self.KILLED if fault and self.mode == "process-kill" else None
            events = {p.process_id: {e["i"] + (rejoin if p.process_id == replaced else 0): e for e in p.steps(180)}
                      for p in processes}
            record.update(self._outcomes({pid: [steps[i] for i in range(first, after)]  # the killed one's are gone
                                          for pid, steps in events.items() if pid != replaced}, elements, since))
            if not fault:
                self.span = max(steps[after - 1]["t"] for steps in events.values()) - start
                record["span_s"] = round(self.span, 3)
            inits = [steps[after + 2] for steps in events.values()]
            sums = [steps[after + 3] for steps in events.values()]
            epochs = {e["result"]["epoch"] for e in inits if e["ok"]}
            record["rejoined"] = (all(e["ok"] for e in inits + sums) and len(epochs) == 1 and epochs.pop() > epoch
                                  and all(bytes.fromhex(c["hex"]) == np.full(4, FILL, np.float32).tobytes()
                                          for e in sums for c in e["result"][0]))
            record["rejoin_s"] = round(max(e["t"] for e in inits) - t, 3)
            if not record["rejoined"]:
                record["rejoin_errors"] = sorted({f"{e['code']}: {e['message'][:200]}" for e in inits + sums
                                                  if not e["ok"]})
        finally:
            for p in processes:
                p.close()
        record["daemon_0"] = footprint(self.cluster.daemons[0].proc.pid)
        return record

    @staticmethod
    def _detection(survivors: dict[int, list[dict]], since: float) -> dict:
        """When node 0's processes failed after the fault, and with what (none failed: the fault came after
        the last collective)."""
        firsts = [next(e for e in events if not e["ok"]) for events in survivors.values()
                  if any(not e["ok"] for e in events)]
        if not firsts:
            return {}
        return {"detection_s": round(max(e["t"] for e in firsts) - since, 3),
                "survivor_codes": sorted({e["code"] for e in firsts}),
                "messages": sorted({e["message"][:160] for e in firsts})}

    @staticmethod
    def _outcomes(outcomes: dict[int, list[dict]], elements: list[int], since: float | None) -> dict:
        """Every process's collectives: results with wrong bytes; collectives that completed for some of
        node 0's processes and failed for others (partial), or completed on node 0 only (the fault came
        after the bytes crossed); results that came after the fault; the codes of the failures."""
        survivors = [pid for pid in sorted(outcomes) if PLACEMENT[pid] == 0]
        out = {"wrong_results": 0, "split_on_node_0": 0, "completed_on_node_0_only": 0, "results_after_fault": 0,
               "completed_collectives": 0}
        codes = set()
        for k, n in enumerate(elements):
            ok = {pid: outcomes[pid][k]["ok"] for pid in outcomes}
            out["wrong_results"] += sum(1 for pid in outcomes if ok[pid] for c in outcomes[pid][k]["result"][0]
                                        if c["sha256"] != _digest(n))
            on_0 = [ok[pid] for pid in survivors]
            out["split_on_node_0"] += int(any(on_0) and not all(on_0))
            out["completed_on_node_0_only"] += int(all(on_0) and not all(ok.values()))
            out["completed_collectives"] += int(all(ok.values()))
            out["results_after_fault"] += sum(1 for pid in outcomes if ok[pid] and since is not None
                                              and outcomes[pid][k]["t"] > since)
            codes |= {outcomes[pid][k]["code"] for pid in outcomes if not ok[pid]}
        out["codes"] = sorted(codes)
        return out


def summarize(records: list[dict], bound: float) -> dict:
    faulted = [r for r in records if "detection_s" in r]
    detections = [r["detection_s"] for r in faulted]
    return {
        "trials": len(records),
        "fault_before_the_end": len(faulted),
        "detection_median_s": round(statistics.median(detections), 3) if detections else None,
        "detection_max_s": max(detections) if detections else None,
        "within_bound": sum(d <= bound for d in detections),
        "codes": sorted({c for r in records for c in r["codes"]}),
        "survivor_codes": sorted({c for r in records for c in r.get("survivor_codes", ())}),
        "partial": sum(r["wrong_results"] + r["split_on_node_0"] for r in records),
        "completed_on_node_0_only": sum(r["completed_on_node_0_only"] for r in records),
        "survivor_served": sum(r["survivor_served"] for r in records),
        "rejoined": sum(r["rejoined"] for r in records),
        "rejoined_within_bound": sum(r["rejoined"] and r["rejoin_s"] <= bound for r in records),
        "rejoin_median_s": round(statistics.median(r["rejoin_s"] for r in records), 3) if records else None,
        "rejoin_max_s": max(r["rejoin_s"] for r in records) if records else None,
    }


def print_trial(r: dict) -> None:
    yes = {True: "yes", False: "NO"}
    print(f"  {r['mode']:12s} {r['trial']:3d}  fault at {r.get('fault_after_s', 0):5.2f} s  "
          f"completed {r['completed_collectives']}/{COLLECTIVES}  "
          f"detection {r.get('detection_s', float('nan')):5.2f} s  "
          f"node 0 got {','.join(r.get('survivor_codes', ())) or '-':11s} wrong {r['wrong_results']}  split "
          f"{r['split_on_node_0']}  node-0-only {r['completed_on_node_0_only']}  served {yes[r['survivor_served']]}  "
          f"rejoined {yes[r['rejoined']]} in {r['rejoin_s']:.2f} s", flush=True)


def run_mode(mode: str, args: argparse.Namespace, flags: list[str], rng: random.Random) -> dict:
    nodes = None
    with contextlib.ExitStack() as stack:
        if mode in LINK_MODES:
            from xreduce_bench.netns import Nodes

            nodes = stack.enter_context(Nodes(2))
            cluster = NamespaceCluster(nodes, flags)
        else:
            cluster = stack.enter_context(Cluster(2, flags))
        trials = Trials(mode, cluster, rng, args, nodes)
        calibration = trials.run(0, fault=False)
        print(f"  {mode}: calibration: the {COLLECTIVES} collectives took {trials.span:.2f} s; "
              f"all completed: {calibration['completed_collectives'] == COLLECTIVES}", flush=True)
        before = footprint(cluster.daemons[0].proc.pid)
        records = []
        for number in range(1, args.trials + 1):
            records.append(trials.run(number))
            print_trial(records[-1])
        after = footprint(cluster.daemons[0].proc.pid)
    return {"calibration": calibration, "trials": records, "daemon_0_before": before, "daemon_0_after": after}


def distinct_jobs(flags: list[str], count: int) -> dict:
    """``count`` jobs one after another, each with a coordinator address of its own, on the same two
    daemons: node 0's daemon serves each job's coordinator. Its footprint after the first and the last."""
    with Cluster(2, flags) as cluster:
        steps = [{"op": "init"}, _small("sum")]
        footprints = []
        for _ in range(count):
            cluster.new_job()
            processes = cluster.launch(PLACEMENT, steps)
            try:
                events = [p.steps(180) for p in processes]
            finally:
                for p in processes:
                    p.close()
            if not all(e["ok"] for process in events for e in process):
                raise RuntimeError(f"a job failed: {events}")
            footprints.append(footprint(cluster.daemons[0].proc.pid))
    return {"jobs": count, "daemon_0": footprints}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="trials per mode (default 20)")
    ap.add_argument("--modes", default="kill,stop,process-kill",
                    help="kill, stop, process-kill, link-down, link-flap (root); default kill,stop,process-kill")
    ap.add_argument("--peer-timeout", type=float, default=2.0)
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    ap.add_argument("--collective-timeout", type=float, default=30.0)
    ap.add_argument("--distinct-jobs", type=int, default=10,
                    help="then this many jobs, each with a coordinator address of its own (0: none)")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--json", default="bench/results/fault-trials.json", help="where the results go ('' none)")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ("kill", "stop", "process-kill", *LINK_MODES)]
    if unknown:
        ap.error(f"--modes: kill, stop, process-kill, link-down or link-flap; got {args.modes!r}")
    if args.trials < 1 or args.distinct_jobs < 0:
        ap.error(f"--trials must be >= 1 and --distinct-jobs >= 0; got {args.trials} and {args.distinct_jobs}")
    flags = ["--backend", "numpy", "--virtual-devices", str(DEVICES), "--peer-timeout", str(args.peer_timeout),
             "--heartbeat-interval", str(args.heartbeat_interval), "--collective-timeout",
             str(args.collective_timeout)]
    bound = 2 * args.peer_timeout
    rng = random.Random(args.seed)
    print(f"fault trials: 2 nodes x 2 processes x 2 devices; {COLLECTIVES} collectives a trial, sizes drawn from "
          f"{SIZES_MIB} MiB a replica (weights {WEIGHTS}); peer timeout {args.peer_timeout} s (bound 2x = {bound} s)")
    results = {"run": {"date": datetime.date.today().isoformat(), "trials": args.trials, "modes": modes,
                       "peer_timeout_s": args.peer_timeout, "heartbeat_interval_s": args.heartbeat_interval,
                       "collective_timeout_s": args.collective_timeout, "seed": args.seed,
                       "placement": PLACEMENT, "devices_per_node": DEVICES, "collectives": COLLECTIVES,
                       "sizes_mib": SIZES_MIB, "weights": WEIGHTS},
               "modes": {}}
    for mode in modes:
        results["modes"][mode] = run_mode(mode, args, flags, rng)
        results["modes"][mode]["summary"] = summarize(results["modes"][mode]["trials"], bound)
    print("\nsummary (node 0 survives; times from the fault)")
    print(f"  {'mode':12s} {'trials':>6s} {'detected':>8s} {'median s':>8s} {'max s':>6s} {'<= 2xpt':>7s} "
          f"{'partial':>7s} {'0-only':>6s} {'served':>6s} {'rejoined':>8s} {'<= 2xpt':>7s} {'rejoin s':>8s}  codes")
    for mode, r in results["modes"].items():
        s = r["summary"]
        print(f"  {mode:12s} {s['trials']:6d} {s['fault_before_the_end']:8d} {s['detection_median_s'] or 0:8.2f} "
              f"{s['detection_max_s'] or 0:6.2f} {s['within_bound']:7d} {s['partial']:7d} "
              f"{s['completed_on_node_0_only']:6d} {s['survivor_served']:6d} "
              f"{s['rejoined']:8d} {s['rejoined_within_bound']:7d} {s['rejoin_median_s']:8.2f}  "
              f"node 0: {','.join(s['survivor_codes'])}; "
              f"all: {','.join(s['codes'])}")
    print("\nnode 0's daemon (threads, open descriptors, resident MiB), after the warm-up and after the trials")
    for mode, r in results["modes"].items():
        b, a = r["daemon_0_before"], r["daemon_0_after"]
        print(f"  {mode:12s} threads {b['threads']} -> {a['threads']}  fds {b['fds']} -> {a['fds']}  "
              f"RSS {b['rss_mib']:.1f} -> {a['rss_mib']:.1f} MiB")
    if args.distinct_jobs:
        results["distinct_jobs"] = jobs = distinct_jobs(flags, args.distinct_jobs)
        first, last = jobs["daemon_0"][0], jobs["daemon_0"][-1]
        print(f"\nnode 0's daemon after {args.distinct_jobs} jobs, each with its own coordinator address (after the "
              f"first -> after the last): threads {first['threads']} -> {last['threads']}  fds {first['fds']} -> "
              f"{last['fds']}  RSS {first['rss_mib']:.1f} -> {last['rss_mib']:.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
