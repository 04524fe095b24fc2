"""What the SDK says and how long it takes when it cannot talk to a daemon, without a daemon.

A TLS daemon closes a plaintext client's connection at once, and so does a
mutual-TLS daemon a client without a certificate: here a socket that accepts
and closes plays that daemon (gRPC reports the same ``Socket closed``), and a
bare gRPC server that answers UNAVAILABLE plays a daemon being restarted.
The real TLS daemons are in tests/integration/test_security.py.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import xreduce
from xreduce._errors import Security, from_rpc_error
from xreduce.distribute import HierarchicalCopyAllReduce, PerReplica
from xreduce.v1 import xreduce_pb2 as pb


@contextlib.contextmanager
def _closing_listener() -> Iterator[str]:
    """An address whose every connection is closed as soon as it is accepted."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()
        thread.join(5)


def test_a_plaintext_call_to_a_tls_daemon_fails_fast_and_says_what_to_set():
    with _closing_listener() as address, xreduce.Client(address, timeout=30) as client:
        for call in (client.list_devices, client.get_status, client.health,
                     lambda: client.broadcast(pb.BroadcastRequest(destinations=["CPU:0"]))):
            with pytest.raises(xreduce.UnavailableError) as e:
                call()
            message = str(e.value)
            assert message.startswith(f"xreduce daemon at {address} is unavailable, probably a TLS mismatch: ")
            assert "--tls-cert" in message and "set XREDUCE_TLS_CA" in message
            assert "XREDUCE_TLS_CLIENT_CERT and XREDUCE_TLS_CLIENT_KEY" in message
            # What gRPC said stays in the message: a close, or a reset when the close found the client's bytes unread.
            assert message.endswith(("Socket closed)", "Connection reset by peer (104))")), message
            assert e.value.code == grpc.StatusCode.UNAVAILABLE


class _Flaky:
    """A bare gRPC server: ListDevices answers UNAVAILABLE ``failures`` times, then a device; Broadcast always
    answers UNAVAILABLE. Counts the calls each got."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = {"ListDevices": 0, "Broadcast": 0}
        handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(self, name)) for name in self.calls}
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("xreduce.v1.CrossDeviceOps",
                                                                                   handlers)])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    def ListDevices(self, request: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802 (the RPC's name)
        self.calls["ListDevices"] += 1
        if self.calls["ListDevices"] <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
        return pb.ListDevicesResponse(devices=[pb.Device(name="CPU:0")]).SerializeToString()

    def Broadcast(self, request: bytes, context: grpc.ServicerContext) -> bytes:  # noqa: N802
        self.calls["Broadcast"] += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")


@pytest.fixture
def flaky():
    servers: list[_Flaky] = []

    def make(failures: int) -> _Flaky:
        servers.append(_Flaky(failures))
        servers[-1].server.start()
        return servers[-1]

    yield make
    for s in servers:
        s.server.stop(None)


def test_idempotent_calls_are_still_retried_on_unavailable(flaky):
    server = flaky(failures=2)
    with xreduce.Client(server.address) as client:
        assert [d.name for d in client.list_devices().devices] == ["CPU:0"]
    assert server.calls["ListDevices"] == 3


def test_idempotent_calls_give_up_after_five_attempts_and_collectives_never_retry(flaky):
    server = flaky(failures=10)
    with xreduce.Client(server.address) as client:
        with pytest.raises(xreduce.UnavailableError, match="the daemon is shutting down$"):
            client.list_devices()
        assert server.calls["ListDevices"] == 5
        with pytest.raises(xreduce.UnavailableError, match="the daemon is shutting down$"):
            client.broadcast(pb.BroadcastRequest(destinations=["CPU:0"]))
        assert server.calls["Broadcast"] == 1


def test_the_retries_keep_within_the_calls_timeout(flaky):
    server = flaky(failures=10)
    with xreduce.Client(server.address) as client:
        with pytest.raises(xreduce.XReduceError):
            client.list_devices(timeout=0.3)
        # The backoff (0.1 s, then 0.4 s) runs past the call's 0.3 s: it gives up before the policy's 5 attempts.
        assert 1 <= server.calls["ListDevices"] < 5


class _Failed(grpc.RpcError):
    def __init__(self, details: str):
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


_CONNECT = "failed to connect to all addresses; last error: "
PLAIN, TLS, MTLS = Security(tls=False), Security(tls=True), Security(tls=True, client_certificate=True)


@pytest.mark.parametrize(("details", "security", "says"), [
    ("UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", PLAIN, "speaks plaintext to a daemon that serves TLS"),
    ("UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", TLS, "set XREDUCE_TLS_CLIENT_CERT and XREDUCE_TLS_CLIENT_KEY"),
    ("UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", MTLS, "--tls-client-ca did not sign"),
    ("UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", None, "check XREDUCE_TLS_CA, XREDUCE_TLS_CLIENT_CERT"),
    ("UNAVAILABLE: ipv4:127.0.0.1:1: recvmsg:Connection reset by peer (104)", PLAIN,
     "speaks plaintext to a daemon that serves TLS"),
    ("UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL "
     "routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification context: OK", TLS,
     "the daemon answered in plaintext"),
    ("UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
     "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK", TLS,
     "set XREDUCE_TLS_CA (root_certificates=) to the CA file that signed the daemon's --tls-cert"),
    ("UNKNOWN: ipv4:127.0.0.1:1: Custom verification check failed with error: UNAUTHENTICATED: Hostname "
     "Verification Check failed.", TLS, "XREDUCE_TLS_SERVER_NAME"),
    ("UNAVAILABLE: ipv4:127.0.0.1:1: Handshake read failed (recvmsg:Connection reset by peer (104))", TLS,
     "the TLS handshake failed"),
], ids=["plaintext", "no-client-cert", "client-cert-refused", "unknown-side", "plaintext-reset", "tls-to-plaintext",
        "unknown-ca", "hostname", "handshake"])
def test_each_tls_failure_says_what_to_check(details, security, says):
    message = str(from_rpc_error(_Failed(_CONNECT + details), "127.0.0.1:1", security))
    assert message.startswith("xreduce daemon at 127.0.0.1:1 is unavailable, probably a TLS mismatch: ")
    assert says in message
    assert message.endswith(f"(gRPC: {_CONNECT + details})")


@pytest.mark.parametrize("details", [
    _CONNECT + "UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused",
    "Socket closed",  # a call in flight when the daemon died: not a connection refused at its start
    "the daemon is shutting down",
])
def test_other_unavailability_gets_no_tls_hint(details):
    message = str(from_rpc_error(_Failed(details), "127.0.0.1:1", PLAIN))
    assert message == f"xreduce daemon at 127.0.0.1:1 is unavailable: {details}"


def test_status_of_a_daemon_that_closes_the_connection_keeps_the_tls_hint(capsys):
    from xreduce import _cli

    with _closing_listener() as address:
        assert _cli.main(["status", "--address", address]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"xreduce status: cannot get the status of the daemon at {address} (UNAVAILABLE): "
                          f"xreduce daemon at {address} is unavailable, probably a TLS mismatch: "), err


@pytest.mark.parametrize(("address", "why"), [
    ("localhost", "no port"),
    ("10.0.0.5", "no port"),
    ("localhost:", "no port"),
    ("localhost:http", "port 'http' is not a number"),
    ("127.0.0.1:0", "port 0 is not in 1..65535"),
    ("127.0.0.1:65536", "port 65536 is not in 1..65535"),
    ("::1:50551", "an IPv6 host goes in brackets, as in [::1]:50551"),
    ("999.1.1.1:50551", "host '999.1.1.1' is not an IPv4 address"),
    ("unix:", "no path"),
])
def test_a_malformed_daemon_address_is_refused_before_any_connection(monkeypatch, address, why):
    form = "must be host:port or unix:PATH; got"
    monkeypatch.setenv("XREDUCE_ADDRESS", address)
    client = xreduce.Client(timeout=30)
    with pytest.raises(ValueError) as raised:
        client.list_devices()
    assert str(raised.value) == f"XREDUCE_ADDRESS {form} {address!r} ({why})"
    with pytest.raises(ValueError) as raised:
        HierarchicalCopyAllReduce().reduce("sum", PerReplica([np.ones(2)], devices=["CPU:0"]), "CPU:0")
    assert str(raised.value) == f"XREDUCE_ADDRESS {form} {address!r} ({why})"
    monkeypatch.delenv("XREDUCE_ADDRESS")
    with pytest.raises(ValueError) as raised:
        xreduce.Client(address)
    assert str(raised.value) == f"address {form} {address!r} ({why})"
    with pytest.raises(ValueError) as raised:
        xreduce.ConnectionOptions(address=address)
    assert str(raised.value) == f"address {form} {address!r} ({why})"


@pytest.mark.parametrize("address", ["127.0.0.1:50551", "localhost:1", "[::1]:50551", "daemon.example:65535",
                                     "unix:/run/xreduce/xreduced.sock", "unix-abstract:xreduce", "dns:///localhost:1"])
def test_well_formed_addresses_are_taken_as_given(monkeypatch, address):
    assert xreduce.Client(address).address == address
    monkeypatch.setenv("XREDUCE_ADDRESS", address)
    assert xreduce.resolve_address() == address
