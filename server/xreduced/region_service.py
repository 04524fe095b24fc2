"""The session and region RPCs of the CrossDeviceOps service.

:class:`RegionService` serves ``OpenSession``, ``RegisterRegion``,
``UnregisterRegion`` and ``ListRegions`` on a :class:`~xreduced.regions.RegionTable`;
the service holds one and hands those RPCs to it. How a request's tensors and
outputs name regions is :mod:`xreduced.decode`'s part.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from xreduce.v1 import xreduce_pb2 as pb

from xreduced.errors import PermissionDenied
from xreduced.regions import RegionTable, probe_shm, session_of

log = logging.getLogger("xreduced.service")

_LOCAL_PEERS = ("unix:", "ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D")
"""``context.peer()`` prefixes of callers on the daemon's host."""


class RegionService:
    """The session and region RPCs, on ``regions``.

    Example:
        >>> rpcs = RegionService(RegionTable())
        >>> rpcs.regions.counts()
        (0, 0)
    """

    def __init__(self, regions: RegionTable):
        self.regions = regions

    def OpenSession(self, request: pb.OpenSessionRequest, context) -> Iterator[pb.OpenSessionResponse]:
        """Opens a session that lasts as long as the call: one reply, then the stream stays open."""
        session = self.regions.open_session()
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

    def RegisterRegion(self, request: pb.RegisterRegionRequest, context) -> pb.RegisterRegionResponse:
        """Maps a region of the caller's memory under a name of its session."""
        peer = context.peer()
        if not peer.startswith(_LOCAL_PEERS):
            raise PermissionDenied(f"name: regions are for callers on the daemon's host (a unix socket or loopback); "
                                   f"this call came from {peer}")
        kind = request.WhichOneof("source") or ""
        self.regions.register(session_of(context), request.name, {"shm_key": "shm"}.get(kind, kind),
                              request.shm_key, request.offset, request.byte_size, request.cuda_ipc)
        return pb.RegisterRegionResponse()

    def UnregisterRegion(self, request: pb.UnregisterRegionRequest, context) -> pb.UnregisterRegionResponse:
        """Releases one region of the session, or all of them (an empty name)."""
        self.regions.unregister(session_of(context), request.name)
        return pb.UnregisterRegionResponse()

    def ListRegions(self, request: pb.ListRegionsRequest, context) -> pb.ListRegionsResponse:
        """The session's regions, by name."""
        return pb.ListRegionsResponse(regions=[
            pb.Region(name=r.name, kind=r.kind, shm_key=r.key if r.kind == "shm" else "", offset=r.offset,
                      byte_size=r.byte_size, in_use=r.in_use)
            for r in self.regions.list(session_of(context))
        ])
