"""The NCCL engine between nodes, with CuPy's NCCL bindings stood in for (this test needs no GPU).

The stand-in (:class:`FakeNccl`, :class:`FakeStream`) goes in through the engine's ``cupy`` parameter. What
it checks is the engine's own part: the unique id through the coordinator's store, the bound on connecting,
the watchdog around an all-reduce (a stream that never finishes, NCCL's asynchronous error, ``close()`` from
another thread, a launch that blocks), and that every failure aborts the communicator and never destroys it.
NCCL itself runs in ``tests/gpu/test_nodes_nccl.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from xreduced import nccl_engine
from xreduced.gloo import EngineError
from xreduced.nccl_engine import UNIQUE_ID_KEY, NcclEngine, bind_interface, interface_of, unavailable_reason

SLACK = 5.0
"""Seconds past an engine's timeout within which its error must have come (a loaded machine)."""

CODES = ["NCCL_INT8", "NCCL_UINT8", "NCCL_INT32", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64", "NCCL_FLOAT16",
         "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_BFLOAT16"]


class FakeComm:
    """A communicator: records what it was made with and what was called; ``hooks`` change its behaviour."""

    def __init__(self, nccl: FakeNccl, size: int, uid: tuple, rank: int):
        if nccl.block_init is not None:
            nccl.block_init.wait(30)
        if nccl.unsigned and any(x < 0 for x in uid):
            raise OverflowError("can't convert negative value to unsigned char")
        self.nccl, self.size, self.uid, self.rank = nccl, size, uid, rank
        self.calls: list[tuple] = []
        self.aborted = threading.Event()
        nccl.comms.append(self)

    def allReduce(self, src, dst, count, code, op, stream):  # noqa: N802 -- CuPy's name
        if self.nccl.block_launch is not None:
            self.nccl.block_launch.wait(30)
        self.calls.append(("allReduce", src, dst, count, code, op, stream))
        self.nccl.stream_done = self.nccl.finish

    def check_async_error(self):
        if self.nccl.async_error is not None:
            raise self.nccl.async_error

    def abort(self):
        self.aborted.set()

    def destroy(self):
        raise AssertionError("the engine must never destroy a communicator (ncclCommDestroy can block)")


class FakeNccl:
    """``cupy.cuda.nccl``: ``get_unique_id``, ``NcclCommunicator``, the type codes, ``NCCL_SUM``."""

    NCCL_SUM = 0

    def __init__(self, finish: bool = True):
        for i, code in enumerate(CODES):
            setattr(self, code, i)
        self.comms: list[FakeComm] = []
        self.finish = finish  # whether a launched all-reduce's stream ever finishes
        self.stream_done = True
        self.async_error: Exception | None = None
        self.block_init: threading.Event | None = None
        self.block_launch: threading.Event | None = None
        self.unsigned = False  # CuPy built where C's char is unsigned (Arm): negative id bytes are refused

    def get_unique_id(self):
        return tuple(range(-64, 64))

    def NcclCommunicator(self, size, uid, rank):  # noqa: N802 -- CuPy's name
        return FakeComm(self, size, uid, rank)


class FakeStream:
    def __init__(self, nccl: FakeNccl):
        self._nccl = nccl
        self.ptr = 1234

    @property
    def done(self) -> bool:
        return self._nccl.stream_done


def fake_cupy(nccl: FakeNccl):
    return SimpleNamespace(cuda=SimpleNamespace(nccl=nccl, Device=lambda gpu: contextlib.nullcontext(),
                                                Stream=lambda non_blocking: FakeStream(nccl)))


class Buffer:
    """A device buffer as the engine sees one: dtype, size, a data pointer."""

    def __init__(self, dtype, size: int, ptr: int = 4096):
        self.dtype, self.size = np.dtype(dtype), size
        self.data = SimpleNamespace(ptr=ptr)


def store():
    table: dict[str, bytes] = {}

    def get(key, timeout):
        end = time.monotonic() + timeout
        while key not in table:
            if time.monotonic() > end:
                raise EngineError(f"key {key!r} was not set within {timeout}s")
            time.sleep(0.01)
        return table[key]

    return table, (table.__setitem__, get, None)


@pytest.fixture(autouse=True)
def _interface(monkeypatch):
    """The engine sets NCCL_SOCKET_IFNAME for the process; the tests keep theirs to themselves."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=lo")


def engine(nccl: FakeNccl | None = None, timeout: float = 5.0) -> NcclEngine:
    _, s = store()
    return NcclEngine(s, 0, 1, "127.0.0.1", timeout, cupy=fake_cupy(nccl or FakeNccl()))


# --- availability --------------------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_the_reason_names_what_to_install():
    why = unavailable_reason("cupy")
    assert why.startswith("CuPy is not installed: ") and "pip install 'xreduce[gpu]'" in why and "NCCL" in why


def test_a_host_backend_cannot_drive_nccl_whatever_is_installed():
    assert unavailable_reason("numpy") == ("the numpy backend keeps node sums in host memory; NCCL between nodes "
                                           "needs --backend cupy")


@pytest.mark.parametrize("change, reason", [
    ({"available": False}, "CuPy finds no NCCL library"),
    ({"get_version": lambda: 2708}, "NCCL 2708 is older than 21000 (2.10)"),
    ({"NCCL_BFLOAT16": None}, "CuPy's NCCL bindings lack bfloat16 (CuPy too old)"),
])
def test_an_unusable_nccl_is_named(change, reason):
    nccl = SimpleNamespace(available=True, get_version=lambda: 22105, **{c: i for i, c in enumerate(CODES)})
    for key, value in change.items():
        if value is None:
            delattr(nccl, key)
        else:
            setattr(nccl, key, value)
    why = nccl_engine._nccl_refusal(nccl)
    assert why.startswith(reason) and "pip install 'xreduce[gpu]'" in why
    assert nccl_engine._nccl_refusal(SimpleNamespace(available=True, get_version=lambda: 22105,
                                                     **{c: i for i, c in enumerate(CODES)})) is None


# --- connecting ----------------------------------------------------------------------------------------------


def test_the_unique_id_travels_through_the_store_from_rank_0_to_the_others():
    table, s = store()
    nccl = FakeNccl()
    engines: dict[int, NcclEngine] = {}
    errors = []

    def make(rank):
        try:
            engines[rank] = NcclEngine(s, rank, 2, "127.0.0.1", 10.0, gpu=0, cupy=fake_cupy(nccl))
        except Exception as e:  # noqa: BLE001 -- the test looks at it
            errors.append(e)

    joiner = threading.Thread(target=make, args=(1,))
    joiner.start()  # rank 1 waits in the store for the id
    time.sleep(0.1)
    make(0)
    joiner.join(20)
    assert not errors and sorted(engines) == [0, 1]
    assert table[UNIQUE_ID_KEY] == bytes(x & 0xFF for x in range(-64, 64))
    by_rank = {c.rank: c for c in nccl.comms}
    assert by_rank[0].uid == by_rank[1].uid == tuple(range(-64, 64)) and by_rank[1].size == 2
    for e in engines.values():
        e.close()


def test_an_id_cupy_takes_as_unsigned_chars_is_given_so():
    nccl = FakeNccl()
    nccl.unsigned = True
    e = engine(nccl)
    assert nccl.comms[0].uid == tuple(x & 0xFF for x in range(-64, 64))
    e.close()


def test_a_rank_whose_id_never_comes_fails_within_the_timeout():
    _, s = store()
    start = time.monotonic()
    with pytest.raises(EngineError, match="not set within"):
        NcclEngine(s, 1, 2, "127.0.0.1", 0.5, cupy=fake_cupy(FakeNccl()))
    assert time.monotonic() - start < 0.5 + SLACK


def test_an_error_of_nccl_before_connecting_is_the_engines():
    nccl = FakeNccl()

    def refuse():
        raise RuntimeError("NCCL_ERROR_SYSTEM_ERROR: no socket interface found")

    nccl.get_unique_id = refuse
    with pytest.raises(EngineError, match=r"NCCL could not connect the 1 nodes from 127.0.0.1 \(rank 0\): "
                                          "RuntimeError: NCCL_ERROR_SYSTEM_ERROR: no socket interface found"):
        engine(nccl)


def test_an_init_that_blocks_is_bounded_and_its_late_communicator_aborted():
    nccl = FakeNccl()
    nccl.block_init = threading.Event()
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"within 0.5s; its init thread is left behind"):
        engine(nccl, timeout=0.5)
    assert time.monotonic() - start < 0.5 + SLACK
    nccl.block_init.set()  # the peers arrive after all: the communicator made then is aborted at once
    deadline = time.monotonic() + 10
    while not nccl.comms and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nccl.comms and nccl.comms[0].aborted.wait(10)


# --- the all-reduce and its watchdog -------------------------------------------------------------------------


def fails_within(e: NcclEngine, nccl: FakeNccl, timeout: float, message: str, bound: float | None = None) -> None:
    """``e``'s all-reduce raises ``message`` within ``bound`` (default: ``timeout``) and some slack, and the
    communicator is aborted."""
    start = time.monotonic()
    with pytest.raises(EngineError, match=message):
        e.all_reduce(Buffer(np.float32, 4), timeout)
    assert time.monotonic() - start < (timeout if bound is None else bound) + SLACK
    assert nccl.comms[0].aborted.is_set()


def test_an_all_reduce_launches_on_the_engines_stream_and_returns_once_done():
    nccl = FakeNccl()
    e = engine(nccl)
    buffer = Buffer(np.complex64, 6, ptr=777)
    assert e.all_reduce(buffer, 5.0) is buffer
    # complex64 crosses as pairs of float32; in place, SUM, on the engine's own stream
    assert nccl.comms[0].calls == [("allReduce", 777, 777, 12, CODES.index("NCCL_FLOAT32"), 0, 1234)]
    assert not nccl.comms[0].aborted.is_set()
    e.close()
    assert nccl.comms[0].aborted.is_set()


def test_a_stream_that_never_finishes_is_aborted_within_the_timeout():
    nccl = FakeNccl(finish=False)
    e = engine(nccl)
    fails_within(e, nccl, 0.3, "did not finish within 0.3s")
    with pytest.raises(EngineError, match="closed"):  # the engine is done: the epoch ends
        e.all_reduce(Buffer(np.float32, 4), 0.3)


def test_an_asynchronous_error_aborts_and_is_raised():
    nccl = FakeNccl(finish=False)
    e = engine(nccl)
    nccl.async_error = RuntimeError("NCCL_ERROR_SYSTEM_ERROR: remote process exited or there was a network error")
    with pytest.raises(EngineError, match="NCCL failed during an all-reduce: RuntimeError: NCCL_ERROR_SYSTEM_ERROR"):
        e.all_reduce(Buffer(np.float32, 4), 10.0)
    assert nccl.comms[0].aborted.is_set()


def test_close_from_another_thread_ends_a_waiting_all_reduce():
    nccl = FakeNccl(finish=False)
    e = engine(nccl)
    closer = threading.Timer(0.2, e.close)
    closer.start()
    fails_within(e, nccl, 30.0, "closed during an all-reduce", bound=0.2)
    closer.join()


def test_a_launch_that_blocks_is_bounded_and_aborted():
    nccl = FakeNccl()
    nccl.block_launch = threading.Event()
    e = engine(nccl)
    fails_within(e, nccl, 0.3, "did not start within 0.3s")
    nccl.block_launch.set()


def test_only_the_dtypes_nccl_adds():
    e = engine()
    assert [e.adds(np.dtype(d)) for d in ("float32", "float16", "complex64", "int16", "bool")] == [
        True, True, True, False, False]
    with pytest.raises(ValueError, match="NCCL cannot add int16"):
        e.all_reduce(Buffer(np.int16, 4), 1.0)
    e.close()


# --- the interface -------------------------------------------------------------------------------------------


def test_the_loopback_address_is_on_lo_and_an_unknown_one_on_none():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None and interface_of("not-an-address") is None


def test_the_interface_of_the_node_address_is_set_unless_the_operator_set_one(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "")
    assert bind_interface("127.0.0.1") == "=lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^docker")
    assert bind_interface("127.0.0.1") == "^docker"
