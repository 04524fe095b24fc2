"""The engine that carries node sums in GPU memory between nodes: NCCL, through CuPy's ``cupy.cuda.nccl``.

One :class:`NcclEngine` per group and epoch, beside the epoch's Gloo engine (:mod:`xreduced.gloo`), when
every node of the group can drive it (the group's engine is then ``gloo+nccl``): one NCCL rank per node
daemon (rank = node index), on the GPU of the daemon's logical device 0. Rank 0 draws NCCL's unique id and
sets it in the coordinator's store (the ``Peers.Store*`` RPCs, as Gloo's ranks meet there); the others read
it from there. The engine all-reduces (SUM) flat CuPy buffers in place, and nothing else: Gloo keeps
carrying the headers, sparse values, broadcasts and host arrays.

NCCL has no timeout of its own, so the engine bounds every wait itself:

* connecting: CuPy's ``NcclCommunicator`` blocks until every rank has joined. It runs in a daemon thread
  the constructor waits for at most ``timeout`` seconds; past that the constructor raises
  :class:`~xreduced.gloo.EngineError` and **leaves the thread behind**, blocked in NCCL's bootstrap (it
  holds no lock, nor the GIL); a communicator it makes later is aborted at once.
* each all-reduce: launched from a daemon thread on the engine's own non-blocking stream (a first launch
  may block while NCCL connects to the peers), then polled every millisecond (the stream, and NCCL's
  asynchronous error) until done. Past ``timeout``, on an asynchronous error, or when :meth:`NcclEngine.close`
  is called meanwhile, the communicator is aborted (``ncclCommAbort``) and ``EngineError`` raised.
* :meth:`NcclEngine.close` aborts; it never calls ``ncclCommDestroy``, which can block forever on a
  communicator whose peer is gone.

NCCL's bootstrap and its socket transport listen on ephemeral ports of one network interface. Before its
first NCCL call the engine sets ``NCCL_SOCKET_IFNAME`` to ``=IFACE`` (an exact match) for the interface
that holds ``--node-address`` (:func:`interface_of`), unless the operator set the variable; NCCL reads it
once per process, so the first group's node address decides for the daemon's life.

The order of additions is NCCL's. With two nodes each element is ``node 0 + node 1``, the same bytes on
both nodes. With more, NCCL adds in its ring's or tree's order, which is fixed for a given buffer size, node
count, NCCL version and topology; ``NCCL_ALGO=Ring`` in every daemon's environment pins the algorithm.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import importlib.util
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from xreduced.backends.nccl import missing_types, nccl_type
from xreduced.gloo import EngineError

log = logging.getLogger("xreduced.nccl_engine")

INSTALL_HINT = ("pip install 'xreduce[gpu]' (CuPy) and NCCL 2.10 or later where CuPy finds it, and run the "
                "daemon with --backend cupy, on every node")
MIN_VERSION = 21000
"""NCCL 2.10: bfloat16, and the communicator's abort and asynchronous error (2.4)."""
UNIQUE_ID_KEY = "nccl/unique-id"
"""The key rank 0 sets NCCL's unique id under, in the epoch's store."""
POLL_SECONDS = 0.001
"""How often a running all-reduce's stream and NCCL's asynchronous error are checked."""

_SIOCGIFADDR = 0x8915


def unavailable_reason(backend: str) -> str | None:
    """Why this daemon cannot drive NCCL between nodes with its ``backend``, or None when it can.

    Example:
        >>> unavailable_reason("numpy")
        'the numpy backend keeps node sums in host memory; NCCL between nodes needs --backend cupy'
    """
    if backend != "cupy":
        return f"the {backend} backend keeps node sums in host memory; NCCL between nodes needs --backend cupy"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed: " + INSTALL_HINT
    return _import_error()


@functools.cache
def _import_error() -> str | None:
    """Imports CuPy's NCCL bindings once; why they cannot serve, or None."""
    try:
        from cupy.cuda import nccl
    except Exception as e:  # noqa: BLE001 -- a broken install can raise anything: it means no engine
        return f"CuPy's NCCL bindings cannot be imported ({type(e).__name__}: {e}): " + INSTALL_HINT
    return _nccl_refusal(nccl)


def _nccl_refusal(nccl: Any) -> str | None:
    """Why the ``cupy.cuda.nccl`` module ``nccl`` cannot serve, or None.

    Example:
        >>> class Old: available = True; get_version = staticmethod(lambda: 2708)
        >>> _nccl_refusal(Old)  # doctest: +ELLIPSIS
        "NCCL 2708 is older than 21000 (2.10): pip install 'xreduce[gpu]' ..."
    """
    if not getattr(nccl, "available", False):
        return "CuPy finds no NCCL library: " + INSTALL_HINT
    try:
        version = int(nccl.get_version())
    except Exception as e:  # noqa: BLE001 -- a library that cannot say its version is not usable
        return f"NCCL cannot say its version ({type(e).__name__}: {e}): " + INSTALL_HINT
    if version < MIN_VERSION:
        return f"NCCL {version} is older than {MIN_VERSION} (2.10): " + INSTALL_HINT
    missing = missing_types(nccl)
    if missing:
        return f"CuPy's NCCL bindings lack {', '.join(missing)} (CuPy too old): " + INSTALL_HINT
    return None


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (IPv4 or IPv6), or None when no interface does.

    Example:
        >>> interface_of("127.0.0.1")
        'lo'
        >>> interface_of("192.0.2.123") is None  # TEST-NET-1: no interface holds it
        True
    """
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return None
    if ip.version == 6:
        return _interface_of_v6(ip)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == str(ip):
                return name
    return None


def _interface_of_v6(ip: ipaddress.IPv6Address) -> str | None:
    try:
        with open("/proc/net/if_inet6") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and ipaddress.IPv6Address(int(fields[0], 16)) == ip:
            return fields[5]
    return None


def bind_interface(address: str) -> str | None:
    """Sets ``NCCL_SOCKET_IFNAME`` to ``=IFACE`` for the interface holding ``address``, unless it is set;
    returns the variable's value (None: unset, NCCL picks its interfaces itself).

    Example:
        >>> import os
        >>> os.environ["NCCL_SOCKET_IFNAME"] = "=eth1"
        >>> bind_interface("127.0.0.1")
        '=eth1'
        >>> del os.environ["NCCL_SOCKET_IFNAME"]
    """
    current = os.environ.get("NCCL_SOCKET_IFNAME")
    if current:
        return current
    name = interface_of(address)
    if name is None:
        log.warning("event=nccl_interface_unknown node_address=%s: no interface holds it; NCCL picks its own "
                    "(set NCCL_SOCKET_IFNAME)", address)
        return None
    os.environ["NCCL_SOCKET_IFNAME"] = "=" + name
    log.info("event=nccl_interface interface=%s node_address=%s", name, address)
    return os.environ["NCCL_SOCKET_IFNAME"]


class NcclEngine:
    """NCCL among a group's node daemons for one epoch; see the module docstring for its bounds.

    Args:
        store: ``(set, get, add)``: the coordinator's store for this group and epoch, as
            :class:`~xreduced.gloo.GlooEngine` takes it; ``get(key, timeout)`` raises
            :class:`~xreduced.gloo.EngineError` when the key is not set in time.
        rank: this node's index; size: the number of nodes.
        address: ``--node-address``: NCCL's sockets go on the interface that holds it (:func:`bind_interface`).
        timeout: the bound on connecting.
        gpu: the CUDA device of this node's rank.
        cupy: the ``cupy`` module (its ``cuda.nccl``, ``cuda.Device``, ``cuda.Stream`` and ``empty``); None:
            imported. Tests pass a stand-in.

    Raises:
        EngineError: the ranks did not all connect within ``timeout``, or NCCL refused.

    Example (CuPy's NCCL bindings stood in for: rank 0 of one node, which sets the unique id):
        >>> from types import SimpleNamespace
        >>> class Comm:
        ...     def __init__(self, size, uid, rank): pass
        ...     def abort(self): print("aborted")
        >>> nccl = SimpleNamespace(NcclCommunicator=Comm, NCCL_FLOAT32=7, get_unique_id=lambda: (-1,) * 128)
        >>> cuda = SimpleNamespace(nccl=nccl, Device=lambda gpu: contextlib.nullcontext(),
        ...                        Stream=lambda non_blocking: None)
        >>> store = {}
        >>> engine = NcclEngine((store.__setitem__, None, None), 0, 1, "127.0.0.1", 5.0,
        ...                     cupy=SimpleNamespace(cuda=cuda))
        >>> store[UNIQUE_ID_KEY][:2], engine.adds(np.dtype(np.float32)), engine.adds(np.dtype(np.int16))
        (b'\\xff\\xff', True, False)
        >>> engine.close(); engine.close()
        aborted
    """

    name = "nccl"

    def __init__(self, store: tuple[Callable, Callable, Callable], rank: int, size: int, address: str,
                 timeout: float, *, gpu: int = 0, cupy: Any = None):
        self._cp = cupy if cupy is not None else importlib.import_module("cupy")
        self._nccl = self._cp.cuda.nccl
        self.rank, self.size, self.gpu = rank, size, gpu
        self._lock = threading.Lock()  # the communicator's checks against its abort
        self._comm: Any = None
        self._closed = False
        deadline = time.monotonic() + timeout
        set_, get, _ = store
        what = f"NCCL could not connect the {size} nodes from {address} (rank {rank})"
        bind_interface(address)
        try:
            with self._cp.cuda.Device(gpu):
                if rank == 0:
                    uid = bytes(x & 0xFF for x in self._nccl.get_unique_id())
                    set_(UNIQUE_ID_KEY, uid)
                self._stream = self._cp.cuda.Stream(non_blocking=True)
            if rank != 0:
                uid = get(UNIQUE_ID_KEY, timeout)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 -- NCCL's or CUDA's error: the join fails, naming it
            raise EngineError(f"{what}: {_short(e)}") from None
        done, error = _bounded(lambda: self._connect(uid), deadline - time.monotonic())
        if not done:
            self.close()
            raise EngineError(f"{what} within {timeout:.3g}s; its init thread is left behind, blocked in NCCL")
        if error is not None:
            self.close()
            raise EngineError(f"{what}: {_short(error)}")

    def _connect(self, uid: bytes) -> None:
        """In the init thread: the communicator, kept, or aborted at once if the engine was closed meanwhile."""
        with self._cp.cuda.Device(self.gpu):
            signed = tuple(b - 256 if b > 127 else b for b in uid)
            try:  # CuPy takes the id as C chars: signed on most platforms, unsigned on some (Arm)
                comm = self._nccl.NcclCommunicator(self.size, signed, self.rank)
            except OverflowError:
                comm = self._nccl.NcclCommunicator(self.size, tuple(uid), self.rank)
        with self._lock:
            if not self._closed:
                self._comm = comm
                return
        with contextlib.suppress(Exception):
            comm.abort()

    def adds(self, dtype: np.dtype) -> bool:
        """Whether NCCL adds ``dtype`` (the same answer on every node: the engine needs every type's binding)."""
        try:
            nccl_type(self._nccl, dtype)
        except ValueError:
            return False
        return True

    def buffers(self, dtype: np.dtype, shapes: list[tuple[int, ...]]) -> tuple[Any, list[Any]]:
        """One flat device buffer on the engine's GPU holding tensors of ``shapes`` back to back, for
        :meth:`all_reduce`, and a C-contiguous view of it per shape (a
        :class:`~xreduced.backends.cupy_ipc.DeviceBits` where CuPy lacks the dtype)."""
        from xreduced.backends.cupy_ipc import device_view

        dtype = np.dtype(dtype)
        counts = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
        with self._cp.cuda.Device(self.gpu):
            data = self._cp.empty(sum(counts) * dtype.itemsize, np.uint8)
        views, at = [], 0
        for shape, count in zip(shapes, counts):
            views.append(device_view(data[at:at + count * dtype.itemsize], dtype, shape))
            at += count * dtype.itemsize
        return device_view(data, dtype, (sum(counts),)), views

    def all_reduce(self, buffer: Any, timeout: float) -> Any:
        """The sum over every node of ``buffer`` (a flat, contiguous device buffer on the engine's GPU of a
        dtype it :meth:`adds`, e.g. from :meth:`buffers`), in place; done on return.

        Raises:
            EngineError: a peer failed, NCCL reported an error, the engine was closed, or the sum was not
                done within ``timeout`` (the communicator is aborted then: the engine is done).
        """
        deadline = time.monotonic() + timeout
        code, per_value = nccl_type(self._nccl, buffer.dtype)
        bits = getattr(buffer, "bits", buffer)  # DeviceBits: the items' bits
        count = int(buffer.size) * per_value
        comm = self._live()

        def launch():
            with self._cp.cuda.Device(self.gpu):
                comm.allReduce(bits.data.ptr, bits.data.ptr, count, code, self._nccl.NCCL_SUM, self._stream.ptr)

        done, error = _bounded(launch, timeout)
        if not done or error is not None:
            self.close()
            raise EngineError(f"NCCL's all-reduce of {count} items did not start within {timeout:.3g}s"
                              if not done else f"NCCL's all-reduce failed to start: {_short(error)}")
        while True:
            with self._lock:
                if self._comm is None:
                    raise EngineError("the NCCL engine was closed during an all-reduce")
                try:
                    self._comm.check_async_error()
                except Exception as e:  # noqa: BLE001 -- NcclError, or whatever a broken library raises
                    failed = f"NCCL failed during an all-reduce: {_short(e)}"
                else:
                    failed = None
            if failed is not None:
                self.close()
                raise EngineError(failed)
            if self._stream.done:
                return buffer
            if time.monotonic() >= deadline:
                self.close()
                raise EngineError(f"NCCL's all-reduce of {count} items did not finish within {timeout:.3g}s")
            time.sleep(POLL_SECONDS)

    def _live(self) -> Any:
        with self._lock:
            if self._comm is None:
                raise EngineError("the NCCL engine is closed")
            return self._comm

    def close(self) -> None:
        """Aborts what is in flight (``ncclCommAbort``, never a destroy that could block). Idempotent."""
        with self._lock:
            self._closed = True
            comm, self._comm = self._comm, None
        if comm is None:
            return
        with contextlib.suppress(Exception), self._cp.cuda.Device(self.gpu):
            comm.abort()


def _bounded(fn: Callable[[], None], seconds: float) -> tuple[bool, BaseException | None]:
    """Runs ``fn`` in a daemon thread, waiting at most ``seconds``: (whether it returned, what it raised).
    A thread still running then is left behind."""
    finished = threading.Event()
    raised: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the waiting thread
            raised.append(e)
        finally:
            finished.set()

    threading.Thread(target=run, name="xreduced-nccl", daemon=True).start()
    if not finished.wait(max(seconds, 0.0)):
        return False, None
    return True, raised[0] if raised else None


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
