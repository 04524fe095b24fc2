"""Unit tests of xreduced.config.resolve(): argument > environment > default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from xreduce import _client, _stall, wire
from xreduced import config
from xreduced.config import Config, resolve

# setting: (argument value, expected from it, environment value, expected from it)
SETTINGS = {
    "listen": ("unix:/tmp/xreduced.sock", "unix:/tmp/xreduced.sock", "0.0.0.0:7000", "0.0.0.0:7000"),
    "backend": ("NumPy", "numpy", "cupy", "cupy"),
    "virtual_devices": ("5", 5, "3", 3),
    "max_message_bytes": ("2048", 2048, "1000", 1000),
    "log_level": ("debug", "DEBUG", "Warning", "WARNING"),
    "grace_seconds": ("2.5", 2.5, "0", 0.0),
    "workers": ("4", 4, "2", 2),
    "collective_timeout": ("1.5", 1.5, "30", 30.0),
    "stall_warning_seconds": ("0.5", 0.5, "0", 0.0),
    "tls_cert": ("/a/cert.pem", "/a/cert.pem", "/b/cert.pem", "/b/cert.pem"),
    "tls_key": ("/a/key.pem", "/a/key.pem", "/b/key.pem", "/b/key.pem"),
    "tls_client_ca": ("/a/ca.pem", "/a/ca.pem", "/b/ca.pem", "/b/ca.pem"),
    "auth_token_file": ("/a/token", "/a/token", "/b/token", "/b/token"),
    "auth_health": ("true", True, "off", False),
    "socket_group": ("xreduce", "xreduce", "trainers", "trainers"),
    "max_request_bytes": ("1000", 1000, "2000", 2000),
    "max_inflight_bytes": ("5000", 5000, "6000", 6000),
    "max_collectives": ("3", 3, "4", 4),
    "max_mapped_bytes": ("8GiB", 8 << 30, "1073741824", 1 << 30),
    "oom_score_adj": ("-1000", -1000, "500", 500),
    "metrics_listen": ("127.0.0.1:9100", "127.0.0.1:9100", "0.0.0.0:9200", "0.0.0.0:9200"),
    "node_address": ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"),
    "peer_timeout": ("8", 8.0, "3.5", 3.5),
    "heartbeat_interval": ("0.5", 0.5, "0.25", 0.25),
    "local_lane": ("false", False, "on", True),
    "lane_express_hold": ("0", 0.0, "2.5", 2.5),
}
DEFAULTS = {
    "listen": "127.0.0.1:50551",
    "backend": "auto",
    "virtual_devices": None,
    "max_message_bytes": 1 << 30,
    "log_level": "INFO",
    "grace_seconds": 10.0,
    "workers": 64,
    "collective_timeout": 60.0,
    "stall_warning_seconds": 10.0,
    "tls_cert": None,
    "tls_key": None,
    "tls_client_ca": None,
    "auth_token_file": None,
    "auth_health": False,
    "socket_group": None,
    "max_request_bytes": 1 << 30,
    "max_inflight_bytes": 4 << 30,
    "max_collectives": 1024,
    "max_mapped_bytes": None,
    "oom_score_adj": -900,
    "metrics_listen": None,
    "node_address": None,
    "peer_timeout": 5.0,
    "heartbeat_interval": 1.0,
    "local_lane": True,
    "lane_express_hold": 0.5,
}
ROOT = Path(__file__).resolve().parents[2]
FLAG = {f: "--" + f.replace("_", "-") for f in SETTINGS}
ENV = {f: "XREDUCE_" + f.upper() for f in SETTINGS}


def test_every_setting_is_covered():
    assert set(SETTINGS) == set(DEFAULTS) == {f.name for f in dataclasses.fields(Config)}


def test_defaults():
    got = resolve([], {})
    assert got == Config()
    assert dataclasses.asdict(got) == DEFAULTS
    assert wire.DEFAULT_ADDRESS == DEFAULTS["listen"]  # the SDK looks where the daemon listens


def test_the_sdk_waits_longer_than_the_daemon_and_warns_when_it_logs():
    """A collective that waits out the daemon's timeout, the default or one the deploy files set, ends with
    the daemon's error (it names the missing processes), not the SDK's own deadline; the SDK's stall warning
    reads the daemon's variable."""
    deployed = [float(v) for f in (ROOT / "deploy").rglob("*.y*ml")
                for v in re.findall(r'XREDUCE_COLLECTIVE_TIMEOUT[:=]\s*"?([\d.]+)', f.read_text())]
    assert deployed, "the deploy files set their collective timeout"
    for timeout in [DEFAULTS["collective_timeout"], *deployed]:
        assert _client.DEFAULT_TIMEOUT >= 2 * timeout
    assert _stall.ENV_STALL_WARNING == config.env_name("stall_warning_seconds")
    assert _stall.DEFAULT_STALL_WARNING_SECONDS == DEFAULTS["stall_warning_seconds"]


@pytest.mark.parametrize("field", SETTINGS)
def test_names(field):
    assert config.flag_name(field) == FLAG[field]
    assert config.env_name(field) == ENV[field]
    assert f"{FLAG[field]} " in config.parser().format_help()
    assert f"[env {ENV[field]}]" in " ".join(config.parser().format_help().split())


@pytest.mark.parametrize("field", SETTINGS)
def test_argument(field):
    arg, want, _, _ = SETTINGS[field]
    got = resolve([FLAG[field], arg], {})
    assert getattr(got, field) == want
    # Nothing else moves.
    assert dataclasses.replace(got, **{field: DEFAULTS[field]}) == Config()


@pytest.mark.parametrize("field", SETTINGS)
def test_environment(field):
    _, _, env, want = SETTINGS[field]
    got = resolve([], {ENV[field]: env})
    assert getattr(got, field) == want
    assert dataclasses.replace(got, **{field: DEFAULTS[field]}) == Config()


@pytest.mark.parametrize("field", SETTINGS)
def test_argument_beats_environment(field):
    arg, want, env, _ = SETTINGS[field]
    assert getattr(resolve([FLAG[field], arg], {ENV[field]: env}), field) == want


@pytest.mark.parametrize("field", SETTINGS)
def test_argument_beats_a_bad_environment_value(field):
    """The environment is not even read when the argument is given."""
    arg, want, _, _ = SETTINGS[field]
    assert getattr(resolve([FLAG[field], arg], {ENV[field]: "not valid"}), field) == want


@pytest.mark.parametrize("field", SETTINGS)
def test_empty_environment_value_means_unset(field):
    assert getattr(resolve([], {ENV[field]: ""}), field) == DEFAULTS[field]


def test_everything_from_the_environment_at_once():
    env = {ENV[f]: v[2] for f, v in SETTINGS.items()}
    assert dataclasses.asdict(resolve([], env)) == {f: v[3] for f, v in SETTINGS.items()}


def test_everything_from_arguments_beats_everything_from_the_environment():
    argv = [x for f, v in SETTINGS.items() for x in (FLAG[f], v[0])]
    env = {ENV[f]: v[2] for f, v in SETTINGS.items()}
    assert dataclasses.asdict(resolve(argv, env)) == {f: v[1] for f, v in SETTINGS.items()}


def test_unrelated_environment_is_ignored():
    assert resolve([], {"XREDUCE_UNKNOWN": "1", "WORKERS": "3", "xreduce_workers": "3"}) == Config()


def test_environ_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("XREDUCE_VIRTUAL_DEVICES", "6")
    monkeypatch.setenv("XREDUCE_LOG_LEVEL", "ERROR")
    got = resolve([])
    assert (got.virtual_devices, got.log_level) == (6, "ERROR")


@pytest.mark.parametrize(
    "value, field, want",
    [
        pytest.param("1", "virtual_devices", 1, id="virtual-devices-1"),
        pytest.param("1", "max_message_bytes", 1, id="max-message-bytes-1"),
        pytest.param("2147483647", "max_message_bytes", 2147483647, id="max-message-bytes-grpc-max"),
        pytest.param("0", "grace_seconds", 0.0, id="grace-seconds-0"),
        pytest.param("1", "workers", 1, id="workers-1"),
        pytest.param("1", "max_mapped_bytes", 1, id="max-mapped-bytes-1"),
        pytest.param("1.5 GiB", "max_mapped_bytes", 3 << 29, id="max-mapped-bytes-spaced"),
        pytest.param("2TiB", "max_mapped_bytes", 2 << 40, id="max-mapped-bytes-tib"),
        pytest.param("1000", "oom_score_adj", 1000, id="oom-score-adj-1000"),
        pytest.param("0", "oom_score_adj", 0, id="oom-score-adj-0"),
        pytest.param("AUTO", "backend", "auto", id="backend-AUTO"),
        pytest.param("error", "log_level", "ERROR", id="log-level-error"),
        pytest.param(" 7 ", "workers", 7, id="workers-padded"),
        pytest.param("127.0.0.1:65535", "listen", "127.0.0.1:65535", id="listen-port-65535"),
        pytest.param("[::]:0", "listen", "[::]:0", id="listen-ipv6-any"),
        pytest.param("localhost:0", "listen", "localhost:0", id="listen-localhost"),
        pytest.param("unix-abstract:xreduced", "listen", "unix-abstract:xreduced", id="listen-abstract"),
        pytest.param("localhost", "node_address", "localhost", id="node-address-localhost"),
        pytest.param("node-1.cluster.local", "node_address", "node-1.cluster.local", id="node-address-name"),
        pytest.param("fd00::1", "node_address", "fd00::1", id="node-address-ipv6"),
    ],
)
def test_boundary_values_are_accepted(value, field, want):
    assert getattr(resolve([FLAG[field], value], {}), field) == want
    assert getattr(resolve([], {ENV[field]: value}), field) == want


# (setting, bad value, the message after "<source> ")
BAD = [
    ("virtual_devices", "0", "must be >= 1; got 0"),
    ("virtual_devices", "-2", "must be >= 1; got -2"),
    ("virtual_devices", "four", "must be int; got 'four'"),
    ("virtual_devices", "2.5", "must be int; got '2.5'"),
    ("backend", "tpu", "must be auto, numpy or cupy; got 'tpu'"),
    ("log_level", "LOUD", "must be DEBUG, INFO, WARNING or ERROR; got 'LOUD'"),
    ("max_message_bytes", "0", "must be in [1, 2147483647] (gRPC's limit); got 0"),
    ("max_message_bytes", "2147483648", "must be in [1, 2147483647] (gRPC's limit); got 2147483648"),
    ("max_message_bytes", "1MiB", "must be int; got '1MiB'"),
    ("grace_seconds", "-1", "must be a number of seconds in [0, 3600]; got -1.0"),
    ("collective_timeout", "0", "must be a number of seconds in (0, 86400]; got 0.0"),
    ("collective_timeout", "nan", "must be a number of seconds in (0, 86400]; got nan"),
    ("stall_warning_seconds", "-1", "must be a number of seconds in [0, 86400] (0: never); got -1.0"),
    ("peer_timeout", "0", "must be a number of seconds in (0, 3600]; got 0.0"),
    ("heartbeat_interval", "nan", "must be a number of seconds in (0, 3600]; got nan"),
    ("stall_warning_seconds", "nan", "must be a number of seconds in [0, 86400] (0: never); got nan"),
    ("grace_seconds", "soon", "must be float; got 'soon'"),
    ("workers", "0", "must be >= 1; got 0"),
    ("workers", "-1", "must be >= 1; got -1"),
    ("workers", "many", "must be int; got 'many'"),
    ("auth_health", "maybe", "must be true or false; got 'maybe'"),
    ("max_inflight_bytes", "0", "must be >= 1; got 0"),
    ("max_collectives", "-3", "must be >= 1; got -3"),
    ("max_mapped_bytes", "0", "must be >= 1; got 0"),
    ("max_mapped_bytes", "lots", "must be a size in bytes (examples: 8589934592, 8GiB, 512MiB); got 'lots'"),
    ("max_mapped_bytes", "8 PiB", "must be a size in bytes (examples: 8589934592, 8GiB, 512MiB); got '8 PiB'"),
    ("oom_score_adj", "-1001", "must be an integer in [-1000, 1000] (the kernel's range for oom_score_adj); "
     "got -1001"),
    ("oom_score_adj", "1001", "must be an integer in [-1000, 1000] (the kernel's range for oom_score_adj); "
     "got 1001"),
    ("oom_score_adj", "-900.5", "must be int; got '-900.5'"),
    ("lane_express_hold", "-0.1", "must be a number of seconds in [0, 60] (0: no express lane); got -0.1"),
    ("lane_express_hold", "nan", "must be a number of seconds in [0, 60] (0: no express lane); got nan"),
    ("listen", "127.0.0.1:99999",
     "must be host:port or unix:PATH; got '127.0.0.1:99999' (port 99999 is not in 0..65535; 0 picks a free port)"),
    ("listen", "127.0.0.1:65536",
     "must be host:port or unix:PATH; got '127.0.0.1:65536' (port 65536 is not in 0..65535; 0 picks a free port)"),
    ("listen", "127.0.0.1:-1", "must be host:port or unix:PATH; got '127.0.0.1:-1' (port '-1' is not a number)"),
    ("listen", "localhost", "must be host:port or unix:PATH; got 'localhost' (no port)"),
    ("listen", ":50551", "must be host:port or unix:PATH; got ':50551' (no host; 0.0.0.0 is every interface)"),
    ("listen", "999.1.1.1:0", "must be host:port or unix:PATH; got '999.1.1.1:0' (host '999.1.1.1' is not an IPv4 "
     "address)"),
    ("listen", "unix:", "must be host:port or unix:PATH; got 'unix:' (no path)"),
    ("node_address", "999.1.1.1",
     "must be an IP address or a host name, without a port; got '999.1.1.1' (not an IPv4 address)"),
    ("node_address", "10.0.0.1:1234",
     "must be an IP address or a host name, without a port; got '10.0.0.1:1234' (a port: the engines pick theirs)"),
    ("node_address", "node_1..example",
     "must be an IP address or a host name, without a port; got 'node_1..example' (not a host name)"),
]
BAD_IDS = [f"{f.replace('_', '-')}-{v}" for f, v, _ in BAD]


@pytest.mark.parametrize("field, value, message", BAD, ids=BAD_IDS)
def test_bad_argument_names_the_flag_and_value(field, value, message):
    with pytest.raises(ValueError) as info:
        resolve([FLAG[field], value], {})
    assert str(info.value) == f"{FLAG[field]} {message}"


@pytest.mark.parametrize("field, value, message", BAD, ids=BAD_IDS)
def test_bad_environment_names_the_variable_and_value(field, value, message):
    with pytest.raises(ValueError) as info:
        resolve([], {ENV[field]: value})
    assert str(info.value) == f"{ENV[field]} {message}"


def test_empty_listen_argument():
    with pytest.raises(ValueError) as info:
        resolve(["--listen", ""], {})
    assert str(info.value) == "--listen must be host:port or unix:PATH; got ''"


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        resolve(["--no-such-flag"], {})
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field, value", [("backend", "TPU"), ("log_level", "loud")], ids=["backend-TPU", "log-level-loud"]
)
def test_bad_value_is_quoted_as_received(field, value):
    with pytest.raises(ValueError) as info:
        resolve([FLAG[field], value], {})
    assert f"got {value!r}" in str(info.value)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_grace_seconds_is_rejected(value):
    with pytest.raises(ValueError) as info:
        resolve(["--grace-seconds", value], {})
    assert "--grace-seconds" in str(info.value) and value in str(info.value)


@pytest.mark.parametrize("settings, message", [
    ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key go together; got only --tls-cert"),
    ({"tls_key": "k.pem"}, "--tls-cert and --tls-key go together; got only --tls-key"),
    ({"tls_client_ca": "ca.pem"}, "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)"),
], ids=["cert-alone", "key-alone", "client-ca-without-tls"])
def test_settings_that_go_together(settings, message):
    with pytest.raises(ValueError) as info:
        config.check(Config(**settings))
    assert str(info.value) == message
    assert config.check(Config(tls_cert="c", tls_key="k", tls_client_ca="ca")).tls_client_ca == "ca"
