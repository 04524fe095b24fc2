"""Who may talk to the daemon: TLS, mutual TLS, a bearer token, socket permissions.

The token is checked first thing in the call pipeline, compared in constant
time; a call without it gets UNAUTHENTICATED. Health and reflection stay open unless
``--auth-health true`` (so that probes and grpcurl ``list`` work without a
secret); everything else needs the token once one is configured.
"""

from __future__ import annotations

import contextlib
import grp
import hmac
import os
import ssl
from collections.abc import Iterator

import grpc

from xreduced.config import Config

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Method prefixes that need no token unless --auth-health is true."""


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise RuntimeError(f"{flag} {path}: cannot read it ({e.strerror})") from None


def load_token(config: Config) -> bytes | None:
    """The bearer token from ``--auth-token-file`` (surrounding whitespace dropped), or None.

    Raises:
        RuntimeError: the file cannot be read or holds no token.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w") as f:
        ...     print("  s3cret", file=f, flush=True)
        ...     load_token(Config(auth_token_file=f.name))
        b's3cret'
    """
    if config.auth_token_file is None:
        return None
    token = _read(config.auth_token_file, "--auth-token-file").strip()
    if not token:
        raise RuntimeError(f"--auth-token-file {config.auth_token_file}: the file is empty")
    return token


def _check_pem(config: Config) -> None:
    """Says which file is wrong before gRPC does (it only says "Failed to bind to address")."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for path, flag in ((config.tls_cert, "--tls-cert"), (config.tls_client_ca, "--tls-client-ca")):
        if path is None:
            continue
        try:
            context.load_verify_locations(cafile=path)
        except ssl.SSLError:
            raise RuntimeError(f"{flag} {path}: holds no PEM certificate") from None
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=lambda: b"")
    except ssl.SSLError as e:
        why = "it does not match the certificate" if "KEY_VALUES_MISMATCH" in str(e) else \
            "not an unencrypted PEM private key"
        raise RuntimeError(f"--tls-key {config.tls_key}: {why} (--tls-cert {config.tls_cert})") from None


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS credentials from ``--tls-cert``/``--tls-key`` (and ``--tls-client-ca``), or None.

    Raises:
        RuntimeError: a file cannot be read, holds no PEM certificate, or the
            key is not the certificate's (unencrypted) PEM private key; the
            message names the flag and the path.

    Example:
        >>> server_credentials(Config()) is None  # no --tls-cert: plaintext
        True
        >>> server_credentials(Config(tls_cert="no-such-cert.pem", tls_key="no-such-key.pem"))
        Traceback (most recent call last):
        ...
        RuntimeError: --tls-cert no-such-cert.pem: cannot read it (No such file or directory)
    """
    if config.tls_cert is None:
        return None
    chain = _read(config.tls_cert, "--tls-cert")
    key = _read(config.tls_key, "--tls-key")
    ca = _read(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca else None
    _check_pem(config)
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)


@contextlib.contextmanager
def private_files() -> Iterator[None]:
    """Files (the unix socket) created inside are mode 0600 from the start.

    Example:
        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as d, private_files():
        ...     open(os.path.join(d, "sock"), "w").close()
        ...     oct(os.stat(os.path.join(d, "sock")).st_mode & 0o777)
        '0o600'
    """
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def protect_socket(path: str, config: Config) -> None:
    """Mode 0600, or 0660 owned by ``--socket-group``.

    Raises:
        RuntimeError: the group does not exist or cannot be given the socket.

    Example:
        >>> import os, tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     protect_socket(f.name, Config())
        ...     oct(os.stat(f.name).st_mode & 0o777)
        '0o600'
        >>> protect_socket("sock", Config(socket_group="no-such-group-xyz"))
        Traceback (most recent call last):
        ...
        RuntimeError: --socket-group no-such-group-xyz: no such group
    """
    if config.socket_group is None:
        os.chmod(path, 0o600)
        return
    try:
        gid = grp.getgrnam(config.socket_group).gr_gid
        os.chown(path, -1, gid)
    except KeyError:
        raise RuntimeError(f"--socket-group {config.socket_group}: no such group") from None
    except OSError as e:
        raise RuntimeError(f"--socket-group {config.socket_group}: cannot give it {path} ({e.strerror})") from None
    os.chmod(path, 0o660)


class TokenCheck:
    """Refuses calls without ``authorization: Bearer <token>`` (UNAUTHENTICATED); the call
    pipeline asks it first (:class:`~xreduced.pipeline.Gate`).

    The scheme is case-insensitive (RFC 7235), the token is compared in
    constant time.

    Example:
        >>> TokenCheck(b"s3cret").allowed((("authorization", "Bearer s3cret"),))
        True
        >>> TokenCheck(b"s3cret").allowed((("authorization", "Bearer guess"),))
        False
        >>> TokenCheck(b"s3cret").refusal("/x.Y/Z", ())
        '/x.Y/Z needs a valid bearer token (authorization: Bearer <token>)'
    """

    def __init__(self, token: bytes, protect_health: bool = False):
        self._expected = token
        self._protect_health = protect_health

    def allowed(self, metadata) -> bool:
        """Whether the call's metadata carries the token (constant-time comparison).

        Example:
            >>> TokenCheck(b"s3cret").allowed([("authorization", "bearer s3cret")])  # any case of the scheme
            True
        """
        given = next((v for k, v in metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        scheme, _, token = given.strip().partition(b" ")
        return hmac.compare_digest(token.strip(), self._expected) and scheme.lower() == b"bearer"

    def refusal(self, method: str, metadata) -> str | None:
        """Why a call of ``method`` is refused, or None: it carries the token, or it is a health or
        reflection call and ``--auth-health`` is false.

        Example:
            >>> TokenCheck(b"s3cret").refusal("/grpc.health.v1.Health/Check", ()) is None
            True
            >>> TokenCheck(b"s3cret", protect_health=True).refusal("/grpc.health.v1.Health/Check", ())
            '/grpc.health.v1.Health/Check needs a valid bearer token (authorization: Bearer <token>)'
        """
        if self.allowed(metadata) or (not self._protect_health and method.startswith(OPEN_SERVICES)):
            return None
        return f"{method} needs a valid bearer token (authorization: Bearer <token>)"


def token_check(config: Config) -> TokenCheck | None:
    """The token check ``--auth-token-file`` asks for, or None without one.

    Raises:
        RuntimeError: the file cannot be read or holds no token.

    Example:
        >>> token_check(Config()) is None  # no --auth-token-file: every caller is let in
        True
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w") as f:
        ...     print("s3cret", file=f, flush=True)
        ...     token_check(Config(auth_token_file=f.name)).allowed([("authorization", "Bearer s3cret")])
        True
    """
    token = load_token(config)
    return TokenCheck(token, config.auth_health) if token is not None else None
