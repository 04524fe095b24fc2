"""One process of a job that spans nodes: join, list the job's devices, reduce known values, print the sums.

Each process talks to its own node's daemon (``XREDUCE_ADDRESS``) and joins the job
named by the three ``KERAS_DISTRIBUTION_*`` variables (or the flags below), whose
first job address is the coordinator on process 0's node. Local replica ``i`` of
process ``p`` holds ``[1, 2, 3, 4] * (100 * p + i + 1)`` and ``[p, i]``; the process
reduces the first with ``HierarchicalCopyAllReduce().reduce(SUM)`` and both with
``batch_reduce(MEAN)``, checks that every local copy of a result is the same, and
prints the results as JSON, one line each, which every process of the job prints
alike::

    devices ["cpu:0", "cpu:1", ...]
    sum [...]
    mean [[...], [...]]

deploy/docker-compose.cluster.yml runs it on two containerised nodes. By hand, two
daemons on this machine stand in for two nodes (any free port for the coordinator)::

    xreduced --listen 127.0.0.1:50561 --virtual-devices 4 &
    xreduced --listen 127.0.0.1:50562 --virtual-devices 4 &
    export KERAS_DISTRIBUTION_JOB_ADDRESSES=127.0.0.1:50570,127.0.0.1:50571 KERAS_DISTRIBUTION_NUM_PROCESSES=2
    XREDUCE_ADDRESS=127.0.0.1:50561 KERAS_DISTRIBUTION_PROCESS_ID=0 python examples/cluster_trainer.py &
    XREDUCE_ADDRESS=127.0.0.1:50562 KERAS_DISTRIBUTION_PROCESS_ID=1 python examples/cluster_trainer.py
"""

from __future__ import annotations

import argparse
import json
import sys

import _project_env  # noqa: F401 -- before numpy and xreduce: without xreduce, reruns this under the project's .venv
import numpy as np
import xreduce
from xreduce import distribution
from xreduce.distribute import HierarchicalCopyAllReduce, MirroredStrategy, PerReplica, ReduceOp

BASE = np.array([1, 2, 3, 4], np.float32)


def replica_values(process_id: int, replicas: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """This process's inputs: per local replica ``i``, ``BASE * (100 * process_id + i + 1)`` and ``[process_id, i]``."""
    scaled = [BASE * np.float32(100 * process_id + i + 1) for i in range(replicas)]
    ids = [np.array([process_id, i], np.float32) for i in range(replicas)]
    return scaled, ids


def same_everywhere(result, what: str) -> list:
    """The one value every local copy of a reduced ``result`` holds, as a list; exits 1 if they differ."""
    copies = [np.asarray(v) for v in getattr(result, "values", [result])]
    if any(c.tobytes() != copies[0].tobytes() for c in copies):
        sys.exit(f"{what}: the local copies differ: {[c.tolist() for c in copies]}")
    return copies[0].tolist()


def run(args: argparse.Namespace) -> None:
    info = distribution.initialize(args.job_addresses, args.num_processes, args.process_id)
    devices = distribution.list_devices()
    ops = HierarchicalCopyAllReduce()
    local = list(MirroredStrategy(cross_device_ops=ops).extended.worker_devices)
    short = ", ".join(xreduce.DeviceName.parse(d).short for d in local)
    print(f"process {info.process_id} of {info.num_processes} (group {info.group or 'none'}): {len(devices)} devices, "
          f"local {short}", flush=True)
    print(f"devices {json.dumps(devices)}", flush=True)
    scaled, ids = replica_values(info.process_id, len(local))
    scaled, ids = PerReplica(scaled, devices=local), PerReplica(ids, devices=local)
    total = ops.reduce(ReduceOp.SUM, scaled, scaled)
    print(f"sum {json.dumps(same_everywhere(total, 'sum'))}", flush=True)
    means = ops.batch_reduce(ReduceOp.MEAN, [(scaled, scaled), (ids, ids)])
    print(f"mean {json.dumps([same_everywhere(m, 'mean') for m in means])}", flush=True)
    ops.close()
    distribution.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job-addresses",
                   help="host:port per process, comma-separated (or KERAS_DISTRIBUTION_JOB_ADDRESSES)")
    p.add_argument("--num-processes", type=int, help="processes in the job (or KERAS_DISTRIBUTION_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process (or KERAS_DISTRIBUTION_PROCESS_ID)")
    run(p.parse_args())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
