"""Sessions and regions for the CrossDeviceOps service.

What the session and region RPCs do, and how a request's tensors and outputs
map onto memory the caller registered (shared memory, or CUDA IPC).
:class:`RegionMixin` holds it; :class:`~xreduced.service.CrossDeviceOpsService`
inherits it and keeps the RPC methods, which call in here.

Example:
    >>> _arrays([None, {0: ("out", 128, "the view")}])
    [None, {0: 'the view'}]
"""

from __future__ import annotations

import logging
import math

import numpy as np
from xreduce.v1 import xreduce_pb2 as pb
from xreduce.wire import codec
from xreduce.wire.layout import OUTPUT_ALIGNMENT, output_layout

from xreduced.engine import Result
from xreduced.errors import InvalidArgument, PermissionDenied, ServiceError
from xreduced.regions import probe_shm, session_of

log = logging.getLogger("xreduced.service")

_LOCAL_PEERS = ("unix:", "ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D")
"""``context.peer()`` prefixes of callers on the daemon's host."""


class RegionMixin:
    """The session and region handling of :class:`~xreduced.service.CrossDeviceOpsService`.

    It uses the service's ``regions`` (a RegionTable) and ``devices`` (a DeviceTable).

    Example:
        >>> from xreduced.service import CrossDeviceOpsService
        >>> issubclass(CrossDeviceOpsService, RegionMixin)
        True
    """

    def _open_session(self, request, context):
        """What ``OpenSession`` does: opens a session that lasts as long as the call."""
        try:
            session = self.regions.open_session()
        except ServiceError as e:
            context.abort(e.code, str(e))
        context.add_callback(lambda: self.regions.session_ended(session.id))
        reason = probe_shm(request.probe_shm_key, bytes(request.probe_nonce)) if request.probe_shm_key else (
            "no probe was sent")
        log.info("event=session_open session=%s... peer=%s shared_memory=%s", session.id[:8], context.peer(),
                 reason is None)
        yield pb.OpenSessionResponse(session_id=session.id, shared_memory=reason is None,
                                     shared_memory_error=reason or "", cuda_ipc=self.regions.cuda_ipc)
        # The stream is the session: it stays open until the client leaves or the daemon stops.
        while context.is_active() and not session.closed.wait(1.0):
            pass
        self.regions.session_ended(session.id)
        log.info("event=session_close session=%s...", session.id[:8])

    def _register_region(self, request, context):
        peer = context.peer()
        if not peer.startswith(_LOCAL_PEERS):
            raise PermissionDenied(f"name: regions are for callers on the daemon's host (a unix socket or loopback); "
                                   f"this call came from {peer}")
        kind = request.WhichOneof("source") or ""
        self.regions.register(session_of(context), request.name, {"shm_key": "shm"}.get(kind, kind),
                              request.shm_key, request.offset, request.byte_size, request.cuda_ipc)
        return pb.RegisterRegionResponse()

    def _unregister_region(self, request, context):
        self.regions.unregister(session_of(context), request.name)
        return pb.UnregisterRegionResponse()

    def _list_regions(self, request, context):
        return pb.ListRegionsResponse(regions=[
            pb.Region(name=r.name, kind=r.kind, shm_key=r.key if r.kind == "shm" else "", offset=r.offset,
                      byte_size=r.byte_size, in_use=r.in_use)
            for r in self.regions.list(session_of(context))
        ])

    def _array(self, tensor: pb.Tensor, field: str):
        """A request's tensor: decoded from its bytes, or a view of the caller's region."""
        if not tensor.HasField("region"):
            return codec.decode(tensor, field)
        dtype, shape = codec.spec(tensor, field)
        carried = [n for n in ("raw_data", "float_values", "int_values", "uint_values") if len(getattr(tensor, n))]
        if carried:
            raise InvalidArgument(f"{field}: names a region and carries {', '.join(carried)}; send one of them")
        want = math.prod(shape) * dtype.itemsize
        r = tensor.region
        if r.byte_size != want:
            raise InvalidArgument(f"{field}.region.byte_size: {r.byte_size} bytes for {dtype.name}{list(shape)}, "
                                  f"expected {want}")
        if r.offset % dtype.itemsize:
            raise InvalidArgument(f"{field}.region.offset: must be a multiple of the {dtype.name} item size "
                                  f"({dtype.itemsize}); got {r.offset}")
        data = self.regions.resolve(r.name, r.offset, r.byte_size, f"{field}.region")
        try:
            return _view(data, dtype, shape)
        except ValueError as e:  # e.g. a zero-size shape whose other dimensions overflow numpy's size type
            raise InvalidArgument(f"{field}.shape: numpy cannot make an array of shape {list(shape)} ({e})") from None

    def _layout(self, output: pb.RegionSlice, results) -> list[dict[int, tuple[str, int, object]]]:
        """Places each result component in ``output`` as :func:`~xreduce.wire.layout.output_layout` says.

        Args:
            results: per result, (destination devices, dtype, shape).

        Returns:
            Per result, destination device -> (region name, offset in it, writable view).
        """
        offsets, total = output_layout([(len(dests), dtype, shape) for dests, dtype, shape in results])
        if total > output.byte_size:
            raise InvalidArgument(f"output.byte_size: the results need {total} bytes ({OUTPUT_ALIGNMENT}-byte "
                                  f"aligned, in order); the slice has {output.byte_size}")
        if output.offset % OUTPUT_ALIGNMENT:
            raise InvalidArgument(f"output.offset: must be a multiple of {OUTPUT_ALIGNMENT}; got {output.offset}")
        out = []
        for (dests, dtype, shape), places in zip(results, offsets):
            nbytes = math.prod(shape) * dtype.itemsize
            mapping = {}
            for d, at in zip(dests, places):
                view = self.regions.resolve(output.name, output.offset + at, nbytes, "output")
                mapping[d] = (output.name, output.offset + at, _view(view, dtype, shape))
            out.append(mapping)
        return out

    def _encode_regions(self, result: Result, out) -> pb.DistributedValue:
        """A result the engine wrote into ``out`` (from :meth:`_layout`): components that name its slices."""
        components = []
        for d in result.devices:  # the engine wrote each result into its view
            name, offset, view = out[d]
            components.append(pb.Component(device=self.devices.name(d).canonical, tensor=pb.Tensor(
                dtype=codec.dtype_enum(view.dtype), shape=view.shape,
                region=pb.RegionSlice(name=name, offset=offset, byte_size=view.nbytes))))
        return pb.DistributedValue(components=components)


def _view(data, dtype: np.dtype, shape: tuple[int, ...]):
    """A region's bytes as an array of ``dtype`` and ``shape`` (numpy, or CuPy for GPU memory)."""
    if isinstance(data, np.ndarray):
        return data.view(dtype).reshape(shape)
    from xreduced.backends.cupy_backend import device_view

    return device_view(data, dtype, shape)


def _arrays(outs):
    """The engine's ``out=``: per result, destination device -> the view to write."""
    return [None if o is None else {d: view for d, (_, _, view) in o.items()} for o in outs]
