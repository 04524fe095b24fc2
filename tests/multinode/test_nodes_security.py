"""Groups across nodes under the daemons' security settings: a bearer token, TLS, mutual TLS.

The coordinator's Peers service takes the settings of the daemon that serves it: with a token, a daemon
that registers without it is refused (UNAUTHENTICATED); with TLS, the daemons reach the coordinator over
TLS. (The bytes between nodes go through Gloo in clear, on the nodes' private addresses.)
"""

from __future__ import annotations

import pytest
from multinode import NODE_FLAGS, OPENSSL, certificates, exact_total, finish, inputs, run_job, same_bytes
from xreduce_bench.faults import Cluster, NodeProcess, decode

pytestmark = pytest.mark.slow

TOKEN = "a-token-the-nodes-share"
SCRIPT = [{"op": "init"}, {"op": "reduce", "seed": 5, "tensors": [{"dtype": "int64", "shape": [3]}]}]


def _check(events: list[list[dict]], replicas: int) -> None:
    want = exact_total(inputs(5, 0, range(replicas), "int64", [3], "int"))
    for pid, (init, reduced) in enumerate(events):
        assert init["ok"] and reduced["ok"], (pid, init, reduced)
        assert init["result"]["num_nodes"] == 2 and init["result"]["engine"] == "gloo"
        assert same_bytes([decode(c) for c in reduced["result"][0]], want), pid


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def test_daemons_sharing_a_token_form_a_group_and_one_without_it_is_refused(start_daemon, token_file):
    flags = [*NODE_FLAGS, "--collective-timeout", "4"]
    cluster = Cluster(2, [*flags, "--auth-token-file", str(token_file)], start=start_daemon)
    _check(run_job(cluster, [0, 1], SCRIPT, env={"XREDUCE_TOKEN": TOKEN}), replicas=8)

    stranger = start_daemon("--listen", "127.0.0.1:0", *flags)
    coordinator = cluster.new_job()
    first = NodeProcess(cluster.address(0), coordinator, 2, 0, SCRIPT[:1], env={"XREDUCE_TOKEN": TOKEN})
    refused = NodeProcess(stranger.address, coordinator, 2, 1, SCRIPT[:1])
    (waited,), (told,) = finish([first, refused])
    assert not told["ok"] and "UNAUTHENTICATED" in told["message"], told
    assert coordinator in told["message"], told["message"]
    assert not waited["ok"] and waited["code"] == "DEADLINE_EXCEEDED" and "[1]" in waited["message"], waited


@pytest.mark.skipif(OPENSSL is None, reason="the openssl command is missing")
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_daemons_serving_tls_form_a_group(start_daemon, tmp_path, mutual):
    pki = certificates(tmp_path)
    flags = [*NODE_FLAGS, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]
    env = {"XREDUCE_TLS_CA": str(pki["ca"])}
    if mutual:
        flags += ["--tls-client-ca", str(pki["ca"])]
        env.update(XREDUCE_TLS_CLIENT_CERT=str(pki["cert"]), XREDUCE_TLS_CLIENT_KEY=str(pki["key"]))
    cluster = Cluster(2, flags, start=start_daemon)
    _check(run_job(cluster, [0, 1], SCRIPT, env=env), replicas=8)
