"""Failure behaviour of multi-process collectives, measured against a real daemon.

Starts ``xreduced`` (numpy backend, 8 host devices, DEBUG log so that every
call's arrival is visible), then:

(a) ``--trials`` times: 3 real worker processes (``xreduce_bench.mp_worker``) join a
    group and run collective 0; then one of them (the victim, rotating) and one
    other enter collective 1 while the third has not arrived, and the victim is
    SIGKILLed. Measured: SIGKILL -> AbortedError at the waiting survivor. Then
    the third arrives (it must get the same error), the survivors re-join under
    a new group name with a restarted victim, and their next collective must
    be bit-exact against a single-process reduction.

(b) The daemon's RSS (VmRSS) and thread count before and after many aborted
    collectives, each a raw gRPC Reduce of one process of a 2-process
    collective with a ``--tensor-mib`` tensor, on a fresh sequence number:

    * ``cancel-after-arrival``: the call is cancelled once the daemon has
      started handling it (from its log) plus 2 ms: the collective aborts;
    * ``cancel-immediately``: ``future.cancel()`` right after sending (100 at most);
    * ``timeout``: a request ``timeout`` of 50 ms, nobody else arrives.

    The rendezvous' state is not exposed over RPC, so each collective is then
    probed by sending the other process's share (timeout 0.3 s): ABORTED or
    DEADLINE_EXCEEDED naming process 0 means the failure is remembered (as
    designed), OK means process 0's share was still waiting although its call
    had ended (a leak), DEADLINE_EXCEEDED waiting for [0] means process 0's
    call never reached the rendezvous.

(c) A participant's call ends while the last arrival computes (3 x ``--race-mib`` MiB): do all
    participants get the same outcome?

(d) On a fresh daemon: how many calls that end just as they arrive (cancelled right after sending)
    it takes until the daemon stops answering ListDevices.

Usage:
    .venv/bin/python bench/multiprocess_faults.py [--trials 20] [--aborts 1000] [--ttl-wait 0]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time

import grpc
import numpy as np
from google.protobuf import duration_pb2
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce.wire import codec
from xreduce_bench import mp_worker
from xreduce_bench.daemon import DaemonProcess

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}".format


def proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def rss_mib(pid: int) -> float:
    return int(proc_status(pid)["VmRSS"].split()[0]) / 1024


def threads(pid: int) -> int:
    return int(proc_status(pid)["Threads"])


class LogWatch:
    """Counts the daemon's ``event=handling method=M`` lines incrementally."""

    def __init__(self, d: DaemonProcess):
        self.d = d
        self.pos = 0
        self.counts: dict[str, int] = {}

    def count(self, method: str) -> int:
        lines = self.d.lines
        while self.pos < len(lines):
            line = lines[self.pos]
            self.pos += 1
            if "event=handling method=" in line:
                m = line.split("event=handling method=", 1)[1].split()[0]
                self.counts[m] = self.counts.get(m, 0) + 1
        return self.counts.get(method, 0)

    def wait(self, method: str, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count(method) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the daemon handled {self.count(method)} {method} calls, not {count}")
            time.sleep(0.0005)


# --- (a) SIGKILL mid-collective ---------------------------------------------------------------------------------


def reference(address: str, step: dict, devices: list[str]) -> dict[str, np.ndarray]:
    arrays = [mp_worker.make_array(step["seed"], 0, g, step["dtype"], step["shape"]) for g in range(len(devices))]
    v = PerReplica(arrays, devices=devices)
    with_ops = HierarchicalCopyAllReduce(address=address)
    try:
        r = with_ops.reduce(step["reduce_op"], v, v)
    finally:
        with_ops.close()
    return dict(zip(r.devices, r.values))


def kill_trial(d: DaemonProcess, watch: LogWatch, trial: int) -> dict:
    count = 3
    victim, waiter, late = trial % 3, (trial + 1) % 3, (trial + 2) % 3
    group, restart = f"bench-kill-{trial}", f"bench-kill-{trial}-restart"
    reduce = {"op": "reduce", "dtype": "float32", "shape": [64], "reduce_op": "sum"}
    nxt = dict(reduce, seed=3)
    steps = [{"op": "init", "stop_on_error": True}, dict(reduce, seed=1), {"op": "barrier"}, dict(reduce, seed=2),
             {"op": "shutdown"}, {"op": "init", "group": restart, "stop_on_error": True}, nxt]
    workers = mp_worker.launch(d.address, [steps] * count, group)
    out = {"trial": trial, "victim": victim}
    try:
        for w in workers:
            assert w.wait_step(1)["ok"], w.steps()
        base = watch.count("Reduce")
        for p in (victim, waiter):
            workers[p].send()
        for p in (victim, waiter):
            workers[p].wait_calling(3)
        watch.wait("Reduce", base + 2)
        time.sleep(0.1)  # from "handling" to waiting in the rendezvous
        killed_at = workers[victim].kill()
        event = workers[waiter].wait_step(3, 30)
        out["delay_ms"] = (event["t"] - killed_at) * 1000
        out["waiter_error"] = event.get("error")
        out["message"] = event.get("message")
        workers[late].send()
        late_event = workers[late].wait_step(3, 30)
        out["late_error"] = late_event.get("error")
        out["same_error"] = late_event.get("message") == event.get("message")
        new = mp_worker.WorkerProcess(d.address, count, victim, [{"op": "init", "stop_on_error": True}, nxt], restart)
        workers.append(new)
        results = {p: workers[p].finish(30) for p in (waiter, late)}
        results[victim] = {6: new.finish(30)[1], 5: new.steps()[0]}
        devices = results[0][5]["result"]["global_devices"]
        want = reference(d.address, nxt, devices)
        exact = True
        for p in range(count):
            event = results[p][6]
            if not event["ok"]:
                exact = False
                continue
            for comp in event["result"]:
                exact &= mp_worker.decode(comp).tobytes() == want[comp["device"]].tobytes()
        out["next_collective_ok"] = exact
    finally:
        for w in workers:
            w.close()
    return out


def part_a(d: DaemonProcess, trials: int) -> dict:
    watch = LogWatch(d)
    print(f"(a) {trials} trials: P=3, one process SIGKILLed while another waits in the collective")
    rows = []
    for i in range(trials):
        r = kill_trial(d, watch, i)
        rows.append(r)
        print(f"  trial {i:2d}: victim {r['victim']}  kill->{r['waiter_error']} {r['delay_ms']:6.1f} ms  "
              f"late arrival: {r['late_error']} (same message: {r['same_error']})  "
              f"restarted job's next collective bit-exact: {r['next_collective_ok']}")
    delays = [r["delay_ms"] for r in rows]
    print(f"  kill->error: median {statistics.median(delays):.1f} ms, max {max(delays):.1f} ms, "
          f"min {min(delays):.1f} ms")
    print(f"  example message: {rows[0]['message']}")
    bad = [r for r in rows if r["waiter_error"] != "AbortedError" or r["late_error"] != "AbortedError"
           or not r["same_error"] or not r["next_collective_ok"]]
    print(f"  trials with an unexpected outcome: {len(bad)}")
    return {"delays": delays, "bad": len(bad)}


# --- (b) memory and threads across many aborted collectives -----------------------------------------------------


class Raw:
    def __init__(self, address: str, mib: float):
        self.channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)])
        self.stub = pb_grpc.CrossDeviceOpsStub(self.channel)
        self.tensor = codec.encode(np.ones(int(mib * (1 << 20)) // 4, np.float32))
        self.tiny = codec.encode(np.ones(1, np.float32))

    def request(self, group: str, seq: int, pid: int, timeout: float | None = None,
                tiny: bool = False) -> pb.ReduceRequest:
        tensor = self.tiny if tiny else self.tensor
        r = pb.ReduceRequest(
            reduce_op=pb.REDUCE_OP_SUM,
            value=pb.DistributedValue(components=[pb.Component(device=CPU(pid), tensor=tensor)]),
            collective=pb.CollectiveSpec(group=group, num_processes=2, process_id=pid, sequence=seq),
        )
        if timeout is not None:
            r.timeout.CopyFrom(duration_pb2.Duration(nanos=int(timeout * 1e9)))
        return r

    def probe(self, group: str, seqs: range, timeout: float = 0.3, parallel: int = 32) -> dict[str, int]:
        """Sends process 1's share (one element: a share still waiting answers with a mismatch) of each
        collective; classifies what the rendezvous had."""
        kinds: dict[str, int] = {}

        def one(seq):
            try:
                self.stub.Reduce(self.request(group, seq, 1, timeout, tiny=True), timeout=timeout + 30)
                return "OK (?)"
            except grpc.RpcError as e:
                msg = e.details() or ""
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT and "but process 0 sent" in msg:
                    return "LEAKED: process 0's share was still waiting although its call had ended"
                if e.code() == grpc.StatusCode.ABORTED and "process 0 left" in msg:
                    return "ABORTED remembered (process 0 left)"
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "waiting for process(es) [1]" in msg:
                    return "DEADLINE_EXCEEDED remembered (process 0 timed out)"
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "waiting for process(es) [0]" in msg:
                    return "DEADLINE_EXCEEDED: process 0 never reached the rendezvous"
                return f"{e.code().name}: {msg[:80]}"

        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            for kind in pool.map(one, seqs):
                kinds[kind] = kinds.get(kind, 0) + 1
        return kinds

    def close(self) -> None:
        self.channel.close()


def part_b(d: DaemonProcess, aborts: int, mib: float, ttl_wait: float) -> dict:
    pid = d.proc.pid
    watch = LogWatch(d)
    raw = Raw(d.address, mib)
    report = {}

    def snap(label):
        time.sleep(0.5)
        r, t = rss_mib(pid), threads(pid)
        print(f"  RSS {r:8.1f} MiB   threads {t:4d}   {label}", flush=True)
        return r, t

    print(f"(b) daemon RSS across {aborts} aborted collectives per mode, {mib:g} MiB tensor each "
          "(2-process collectives, one process sends, on fresh sequence numbers)")
    # Warm up: a few complete collectives so that the pools and arenas exist.
    for seq in range(5):
        futs = [raw.stub.Reduce.future(raw.request("warm", seq, p), timeout=30) for p in (0, 1)]
        for f in futs:
            f.result()
    report["before"] = snap("before (after 5 complete warm-up collectives)")

    # cancel after arrival
    t0 = time.monotonic()
    for seq in range(aborts):
        base = watch.count("Reduce")
        fut = raw.stub.Reduce.future(raw.request("cancel-after", seq, 0), timeout=60)
        watch.wait("Reduce", base + 1)
        time.sleep(0.002)
        fut.cancel()
    print(f"  sent and cancelled {aborts} calls in {time.monotonic() - t0:.1f}s")
    report["after_cancel_after"] = snap(f"after {aborts} cancel-after-arrival aborts")
    kinds = raw.probe("cancel-after", range(aborts))
    print(f"  probe: {kinds}")
    report["probe_cancel_after"] = kinds
    snap("after probing them")

    # cancel immediately (few: each leaked share holds one of the daemon's worker threads; see (d))
    t0 = time.monotonic()
    racy = min(aborts, 100)
    for seq in range(racy):
        raw.stub.Reduce.future(raw.request("cancel-now", seq, 0), timeout=60).cancel()
    time.sleep(1.0)
    print(f"  sent and cancelled {racy} calls at once in {time.monotonic() - t0:.1f}s")
    report["after_cancel_now"] = snap(f"after {racy} cancel-immediately calls")
    t0 = time.monotonic()
    try:
        raw.stub.ListDevices(pb.ListDevicesRequest(), timeout=5)
        print(f"  ListDevices now answers in {(time.monotonic() - t0) * 1000:.1f} ms")
    except grpc.RpcError as e:
        print(f"  ListDevices now FAILS: {e.code().name} after {time.monotonic() - t0:.1f}s "
              "(every worker thread is held by a leaked share?)")
    kinds = raw.probe("cancel-now", range(racy))
    print(f"  probe: {kinds}")
    report["probe_cancel_now"] = kinds
    snap("after probing them (a probe completes a leaked collective)")

    # timeouts
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        def one(seq):
            try:
                raw.stub.Reduce(raw.request("timeout", seq, 0, 0.05), timeout=30)
                return "OK"
            except grpc.RpcError as e:
                return e.code().name
        codes: dict[str, int] = {}
        for c in pool.map(one, range(aborts)):
            codes[c] = codes.get(c, 0) + 1
    print(f"  {aborts} calls with a 50 ms timeout in {time.monotonic() - t0:.1f}s: {codes}")
    report["after_timeout"] = snap(f"after {aborts} timed-out collectives")
    kinds = raw.probe("timeout", range(aborts))
    print(f"  probe: {kinds}")
    report["probe_timeout"] = kinds
    snap("after probing them")

    if ttl_wait > 0:
        print(f"  waiting {ttl_wait:g}s for the remembered failures to expire (failed_ttl=60s)...")
        time.sleep(ttl_wait)
        # Expiry runs on the next collective.
        futs = [raw.stub.Reduce.future(raw.request("after-ttl", 0, p), timeout=30) for p in (0, 1)]
        for f in futs:
            f.result()
        report["after_ttl"] = snap("after the TTL and one more collective")

    # Still serving?
    futs = [raw.stub.Reduce.future(raw.request("final", 0, p), timeout=30) for p in (0, 1)]
    results = [f.result() for f in futs]
    good = all(np.all(codec.decode(r.result.components[0].tensor) == 2) for r in results)
    devices = len(raw.stub.ListDevices(pb.ListDevicesRequest(), timeout=10).devices)
    print(f"  afterwards: a complete collective {'works' if good else 'FAILED'}; ListDevices -> {devices} devices; "
          f"internal errors in the log: {d.log().count('event=internal_error')}")
    raw.close()
    return report


# --- (c) a participant leaves while the last arrival computes -----------------------------------------------------


def part_c(d: DaemonProcess, mib: float, delays: list[float]) -> list[dict]:
    """3 raw shares of ``mib`` MiB; processes 0 and 1 wait, process 2 arrives last and computes; process 0's
    call is cancelled ``delay`` s after process 2's call is handled."""
    watch = LogWatch(d)
    raw = Raw(d.address, mib)

    def request(group, pid):
        r = raw.request(group, 0, pid)
        r.collective.num_processes = 3
        return r

    print(f"(c) process 0's call ends while process 2 (the last arrival) computes: 3 x {mib:g} MiB")
    t0 = time.monotonic()
    futs = [raw.stub.Reduce.future(request("c-warm", p), timeout=60) for p in range(3)]
    for f in futs:
        f.result()
    print(f"  a complete collective takes {time.monotonic() - t0:.2f}s")
    rows = []
    for delay in delays:
        group = f"c-{delay}"
        base = watch.count("Reduce")
        f0, f1 = (raw.stub.Reduce.future(request(group, p), timeout=60) for p in (0, 1))
        watch.wait("Reduce", base + 2)
        time.sleep(0.05)
        f2 = raw.stub.Reduce.future(request(group, 2), timeout=60)
        watch.wait("Reduce", base + 3, 30)
        time.sleep(delay)
        f0.cancel()
        row = {"delay": delay}
        for p, f in ((1, f1), (2, f2)):
            try:
                f.result()
                row[p] = "OK"
            except grpc.RpcError as e:
                row[p] = f"{e.code().name} ({(e.details() or '')[-60:]})"
        rows.append(row)
        print(f"  cancel {delay * 1000:4.0f} ms after process 2 arrived: process 1 -> {row[1]}; process 2 -> {row[2]}")
    raw.close()
    return rows


# --- (d) how many calls ending on arrival wedge the daemon --------------------------------------------------------


def part_d(limit: int) -> dict:
    """A fresh daemon (default --workers 64, --collective-timeout 60): calls cancelled right after sending,
    in batches of 20, until ListDevices stops answering within 2 s (or ``limit`` calls)."""
    d = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "8"])
    raw = Raw(d.address, 0.0625)
    print("(d) a fresh daemon (--workers 64, --collective-timeout 60): 2-process collectives whose one "
          "share is cancelled right after sending, until ListDevices stops answering")
    sent, wedged = 0, None
    try:
        while sent < limit:
            for _ in range(20):
                raw.stub.Reduce.future(raw.request("wedge", sent, 0), timeout=600).cancel()
                sent += 1
            time.sleep(0.3)
            t0 = time.monotonic()
            try:
                raw.stub.ListDevices(pb.ListDevicesRequest(), timeout=2)
            except grpc.RpcError as e:
                wedged = sent
                print(f"  after {sent} such calls ListDevices fails: {e.code().name} after "
                      f"{time.monotonic() - t0:.1f}s; daemon threads {threads(d.proc.pid)}")
                break
        if wedged is None:
            print(f"  ListDevices still answers after {sent} such calls")
    finally:
        raw.close()
        d.kill()
    return {"sent": sent, "wedged_after": wedged}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--aborts", type=int, default=1000)
    ap.add_argument("--tensor-mib", type=float, default=1.0)
    ap.add_argument("--wedge-limit", type=int, default=2000, help="most calls (d) sends")
    ap.add_argument("--race-mib", type=float, default=32.0, help="tensor size of (c)")
    ap.add_argument("--race-delays", default="0.05,0.15,0.3,0.6,1.0",
                    help="seconds after the last arrival that (c) cancels process 0's call")
    ap.add_argument("--ttl-wait", type=float, default=0.0,
                    help="seconds to wait, after (b), for remembered failures to expire (65 to see it)")
    args = ap.parse_args(argv)
    d = DaemonProcess(["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "8",
                       "--log-level", "DEBUG"])
    try:
        print(f"daemon pid {d.proc.pid} at {d.address}, serving after {d.serving_after:.2f}s; "
              f"RSS {rss_mib(d.proc.pid):.1f} MiB")
        a = part_a(d, args.trials)
        b = part_b(d, args.aborts, args.tensor_mib, args.ttl_wait)
        c = part_c(d, args.race_mib, [float(x) for x in args.race_delays.split(",")])
        w = part_d(args.wedge_limit)
        print("\nreport")
        print(f"  SIGKILL -> AbortedError at the survivor: median {statistics.median(a['delays']):.1f} ms, "
              f"max {max(a['delays']):.1f} ms over {len(a['delays'])} trials; unexpected outcomes: {a['bad']}")
        before = b["before"][0]
        for key, label in (("after_cancel_after", "cancel-after-arrival"), ("after_cancel_now", "cancel-immediately"),
                           ("after_timeout", "timeout"), ("after_ttl", "the TTL + one collective")):
            if key in b:
                print(f"  RSS after {label:22s}: {b[key][0]:8.1f} MiB ({b[key][0] - before:+.1f} MiB vs "
                      f"{before:.1f} MiB before), threads {b[key][1]}")
        for key in ("probe_cancel_after", "probe_cancel_now", "probe_timeout"):
            print(f"  {key}: {b[key]}")
        split = [r for r in c if (r[1] == "OK") != (r[2] == "OK")]
        print(f"  (c) collectives that completed for one participant and aborted for another: {len(split)} of "
              f"{len(c)}")
        print(f"  (d) calls ending on arrival until the daemon stopped answering: {w['wedged_after'] or 'never'} "
              f"(of {w['sent']} sent)")
    finally:
        d.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
