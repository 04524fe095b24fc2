"""The traced step's all-reduce as a TF kernel of its own: no Python, no ``tf.numpy_function``, in the step.

A prepared batch (:mod:`xreduce._prepared`) is the same call step after step; its
:meth:`~xreduce._prepared.PreparedBatch.native` part (segments, the request frame, the
offsets) is all a kernel needs to make it. ``lane_kernel.cc`` is that kernel,
``XreduceLaneCall``: it copies the inputs into the staging segment, sends the
request frame over a local-lane connection of its own, and hands TF the results as
tensors over their places in the output segment (results TF still holds at the next
call first move to memory of their own). The ``tf.numpy_function`` bridge alone cost
about a quarter of a small model's step (the GIL, the conversions, TF's py_func
machinery); the kernel costs one copy and one exchange with the daemon.

The kernel is built from source the first time a process needs it, with the C++
compiler (``CXX``, else ``c++``/``g++`` on ``PATH``) and TF's own flags
(``tf.sysconfig``), into :func:`cache_dir`, under a name that changes with TF's
version, the flags and the source: about 10 s once, then loaded in milliseconds.
Where it cannot be built (no compiler), a warning says why once and the step takes
the ``tf.numpy_function`` bridge, with the same numbers. ``XREDUCE_TF_KERNEL=0``
turns the kernel off.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import tensorflow as tf

from xreduce._errors import XReduceError
from xreduce._prepared import PreparedBatch
from xreduce._runtime import ProcessGroup
from xreduce.tensorflow import _bridge

ENV_KERNEL = "XREDUCE_TF_KERNEL"
"""``0``/``false``/``off``: the traced step's all-reduce never takes the kernel (the ``tf.numpy_function``
bridge instead)."""

ENV_CACHE_DIR = "XREDUCE_CACHE_DIR"
"""Where the built kernel is kept (default: ``$XDG_CACHE_HOME/xreduce``, else ``~/.cache/xreduce``)."""

SOURCE = Path(__file__).with_name("lane_kernel.cc")
BUILD_TIMEOUT_SECONDS = 600.0

_lock = threading.Lock()
_library: list[Any] = []  # once tried: [module, path] or [None]


def enabled() -> bool:
    """Whether this process may use the kernel (``XREDUCE_TF_KERNEL`` is not off).

    Example:
        >>> os.environ["XREDUCE_TF_KERNEL"] = "0"; enabled()
        False
        >>> del os.environ["XREDUCE_TF_KERNEL"]; enabled()
        True
    """
    return os.environ.get(ENV_KERNEL, "").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where built kernels are kept.

    Example:
        >>> os.environ["XREDUCE_CACHE_DIR"] = "/tmp/xr"; str(cache_dir())
        '/tmp/xr'
        >>> del os.environ["XREDUCE_CACHE_DIR"]; cache_dir().name
        'xreduce'
    """
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xreduce"


def compiler() -> str | None:
    """The C++ compiler the kernel is built with: ``CXX``, else ``c++`` or ``g++`` on ``PATH``; None if none.

    Example:
        >>> compiler() is None or os.path.basename(compiler().split()[0]) != ""
        True
    """
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build() -> Path:
    """The kernel's library for this TF, built now unless :func:`cache_dir` has it (one process builds, the
    others wait for it).

    Raises:
        RuntimeError: no compiler, or the compiler failed (its message says why).

    Example:
        >>> build().suffix
        '.so'
    """
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install one: Debian's g++)")
    flags = [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, tf.__version__.encode(), cxx.encode(), *map(str.encode, flags)]))
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"xreduce-lane-kernel-tf{tf.__version__}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    with open(directory / (path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        command = [*cxx.split(), "-shared", "-fPIC", "-O2", "-Wno-deprecated-declarations", str(SOURCE), "-o",
                   str(part), *flags]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{cxx} could not build {SOURCE.name}: {e}") from None
        if done.returncode != 0:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
            raise RuntimeError(f"{cxx} could not build {SOURCE.name} (exit status {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        os.replace(part, path)
    return path


def library() -> Any | None:
    """The loaded kernel library (its op: ``xreduce_lane_call``), built if needed; None when it is off or cannot be
    built (a warning says why, once a process).

    Example:
        >>> hasattr(library(), "xreduce_lane_call")
        True
    """
    if not enabled():
        return None
    with _lock:
        if not _library:
            try:
                path = build()
                _library[:] = [tf.load_op_library(str(path)), path]
            except (RuntimeError, OSError, tf.errors.OpError) as e:
                warnings.warn(f"xreduce.tensorflow: the traced step's all-reduce takes the tf.numpy_function "
                              f"bridge, not xreduce's TF kernel, which could not be had: {e}", RuntimeWarning,
                              stacklevel=2)
                _library.append(None)
        return _library[0]


def calls() -> int:
    """How many calls this process's kernels made that the daemon answered with results (0 before any).

    Example:
        >>> calls() >= 0
        True
    """
    return _counter("xreduce_lane_kernel_calls")


def detaches() -> int:
    """How many of this process's kernels' calls first moved results TF still held to memory of their own (0 before
    any): a result stays where the daemon wrote it until the next call, which moves it aside if TF still holds it.
    A Keras step lets its gradients go once applied, so it never needs to.

    Example:
        >>> detaches() >= 0
        True
    """
    return _counter("xreduce_lane_kernel_detaches")


def _counter(name: str) -> int:
    """The kernel library's counter ``name`` (a C function returning an int64), 0 before the library is loaded."""
    loaded = _loaded()
    if loaded is None:
        return 0
    count = getattr(loaded, name)
    count.restype = ctypes.c_int64
    return int(count())


class Times(NamedTuple):
    """Seconds the kernels' answered calls spent in each part of a call, summed (:func:`times`).

    Example:
        >>> Times(0.001, 0.002, 0.0005).exchange
        0.002
    """

    copy_in: float
    """Copying the inputs into the staging segment."""
    exchange: float
    """Sending the request and waiting for the reply: the transport and the daemon."""
    copy_out: float
    """Copying the results out of the output segment into TF's tensors."""


def times() -> Times:
    """Where this process's kernels' answered calls (:func:`calls`) spent their time, summed over them: what a
    step's all-reduce costs on each side of the daemon (all zero before any).

    Example:
        >>> spent = times()  # and again after some steps: the difference, over the steps, is a step's
        >>> spent._fields, all(t >= 0 for t in spent)
        (('copy_in', 'exchange', 'copy_out'), True)
    """
    loaded = _loaded()
    if loaded is None:
        return Times(0.0, 0.0, 0.0)
    nanos = (ctypes.c_int64 * 3)()
    loaded.xreduce_lane_kernel_nanos(nanos)
    return Times(*(n / 1e9 for n in nanos))


def _loaded() -> ctypes.CDLL | None:
    """The kernel library this process loaded, for its C functions (None before it is loaded): the library TF
    loaded, which dlopen hands out again."""
    with _lock:
        path = _library[1] if len(_library) > 1 else None
    return None if path is None else ctypes.CDLL(str(path))


class SequenceCounter:
    """A group's sequence counter (``ProcessGroup._counter``) that this process's kernels share: an int64 the
    kernels and Python take numbers from atomically (the library's ``xreduce_next_sequence``), so that the k-th
    collective of every process is still the k-th, whoever makes it. Its memory lives as long as the process (a
    traced step may hold its address).

    Example:
        >>> counter = SequenceCounter(5, library_path())
        >>> next(counter), next(counter)
        (5, 6)
    """

    _kept: list[ctypes.c_int64] = []

    def __init__(self, start: int, path: Path):
        self.cell = ctypes.c_int64(start)
        SequenceCounter._kept.append(self.cell)
        self.address = ctypes.addressof(self.cell)
        self._next = ctypes.CDLL(str(path)).xreduce_next_sequence
        self._next.argtypes, self._next.restype = [ctypes.c_void_p], ctypes.c_int64

    def __iter__(self):
        return self

    def __next__(self) -> int:
        return int(self._next(self.address))


def shared_counter(group: ProcessGroup) -> int:
    """The address of ``group``'s sequence counter, made a :class:`SequenceCounter` (from its next number) the
    first time a kernel needs it."""
    path = library_path()
    with group._lock:
        counter = group._counter
        if not isinstance(counter, SequenceCounter):
            counter = group._counter = SequenceCounter(next(counter), path)
        return counter.address


def library_path() -> Path:
    """The loaded kernel library's file (:func:`library` loads it first).

    Raises:
        RuntimeError: the kernel is off or could not be had.
    """
    if library() is None:
        raise RuntimeError("xreduce's TF kernel is off or could not be built")
    with _lock:
        return _library[1]


def call(prepared: PreparedBatch, inputs: Sequence[tf.Tensor], outputs: Sequence[tuple[tf.DType, tf.TensorShape]],
         name: str) -> list[tf.Tensor] | None:
    """The batch's results as the kernel's outputs in the graph being traced, or None when the kernel cannot make
    this call (off, not built, or the batch has no native part: no local lane or no shared memory).

    ``prepared``'s native segments must outlive the traced function: the caller keeps ``prepared``.
    """
    lib = library()
    try:
        native = prepared.native() if lib is not None else None
    except XReduceError as e:
        raise _bridge.tf_error(e) from None
    if native is None:
        return None
    for k, ((dtype, shape), (_, np_dtype, np_shape)) in enumerate(zip(outputs, native.outputs)):
        if dtype.as_numpy_dtype != np_dtype or tuple(shape.as_list()) != np_shape:
            raise ValueError(f"outputs[{k}]: {dtype.name}{shape} expected by the step; the prepared batch gives "
                             f"{np_dtype.name}{list(np_shape)}")
    return list(lib.xreduce_lane_call(
        list(inputs), U=[dtype for dtype, _ in outputs], output_shapes=[shape for _, shape in outputs],
        address=native.address, daemon=native.daemon, hello=native.hello, request=native.request,
        staging=native.staging, staging_bytes=native.staging_bytes, output=native.output,
        output_bytes=native.output_bytes, input_offsets=list(native.input_offsets),
        output_offsets=[at for at, _, _ in native.outputs], timeout=native.timeout, name=name,
        phases=[request for request, _ in native.phases],
        phase_ranges=[n for k, (_, ranges) in enumerate(native.phases) for r in ranges for n in (k, *r)],
        collective=native.collective, sequence=0 if native.group is None else shared_counter(native.group)))
