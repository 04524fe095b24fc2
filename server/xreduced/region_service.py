"""The session and region RPCs of the CrossDeviceOps service.

:class:`RegionService` serves ``OpenSession``, ``RegisterRegion``,
``UnregisterRegion`` and ``ListRegions`` on a :class:`~xreduced.regions.RegionTable`;
the service holds one and hands those RPCs to it. How a request's tensors and
outputs name regions is :mod:`xreduced.decode`'s part.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Protocol

from xreduce.v1 import xreduce_pb2 as pb

from xreduced.errors import PermissionDenied
from xreduced.regions import RegionTable, session_of

log = logging.getLogger("xreduced.service")

_LOCAL_PEERS = ("unix:", "ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D")
"""``context.peer()`` prefixes of callers on the daemon's host."""


class Lane(Protocol):
    """The local lane, as sessions learn of it (:class:`~xreduced.lane.LocalLane`).

    Example:
        >>> from types import SimpleNamespace
        >>> lane: Lane = SimpleNamespace(address="unix-abstract:lane")
        >>> lane.address
        'unix-abstract:lane'
    """

    address: str
    """Where callers on this host reach it."""


class RegionService:
    """The session and region RPCs, on ``regions``.

    Example:
        >>> from types import SimpleNamespace
        >>> rpcs = RegionService(RegionTable())
        >>> rpcs.ListRegions(pb.ListRegionsRequest(), SimpleNamespace(invocation_metadata=lambda: ()))
        Traceback (most recent call last):
        ...
        xreduced.errors.FailedPrecondition: session: regions belong to a session; send the 'x-xreduce-session'
        metadata that OpenSession returned; got none
    """

    def __init__(self, regions: RegionTable, lane: Callable[[], Lane | None] = lambda: None):
        self.regions = regions
        self.lane = lane
        """The local lane once it is open, offered to sessions of callers on this host; None: none."""

    def OpenSession(self, request: pb.OpenSessionRequest, context) -> Iterator[pb.OpenSessionResponse]:
        """Opens a session that lasts as long as the call: one reply, then the stream stays open.

        Example:
            >>> from types import SimpleNamespace
            >>> rpcs = RegionService(RegionTable())
            >>> context = SimpleNamespace(add_callback=lambda callback: None, peer=lambda: "unix:")
            >>> first = next(rpcs.OpenSession(pb.OpenSessionRequest(), context))
            >>> first.shared_memory, first.shared_memory_error, rpcs.regions.counts()
            (False, 'no probe was sent', (1, 0))
        """
        session = self.regions.open_session()
        context.add_callback(lambda: self.regions.session_ended(session.id))
        peer = context.peer()
        local = peer.startswith(_LOCAL_PEERS)
        lane = self.lane()
        if not local:  # RegisterRegion would refuse it: say so now, the SDK takes the wire
            reason = f"regions are for callers on the daemon's host (a unix socket or loopback); this is {peer}"
        elif request.probe_shm_key:
            reason = self.regions.probe(request.probe_shm_key, bytes(request.probe_nonce))
        else:
            reason = "no probe was sent"
        log.info("event=session_open session=%s... peer=%s shared_memory=%s", session.id[:8], peer,
                 reason is None)
        yield pb.OpenSessionResponse(session_id=session.id, shared_memory=reason is None,
                                     shared_memory_error=reason or "", cuda_ipc=self.regions.cuda_ipc,
                                     local_lane=lane.address if local and lane is not None else "")
        # The stream is the session: it stays open until the client leaves or the daemon stops.
        while context.is_active() and not session.closed.wait(1.0):
            pass
        self.regions.session_ended(session.id)
        log.info("event=session_close session=%s...", session.id[:8])

    def RegisterRegion(self, request: pb.RegisterRegionRequest, context) -> pb.RegisterRegionResponse:
        """Maps a region of the caller's memory under a name of its session.

        Example:
            >>> from types import SimpleNamespace
            >>> remote = SimpleNamespace(peer=lambda: "ipv4:10.0.0.5:41234")
            >>> RegionService(RegionTable()).RegisterRegion(pb.RegisterRegionRequest(name="in"), remote)
            Traceback (most recent call last):
            ...
            xreduced.errors.PermissionDenied: name: regions are for callers on the daemon's host (a unix socket or
            loopback); this call came from ipv4:10.0.0.5:41234
        """
        peer = context.peer()
        if not peer.startswith(_LOCAL_PEERS):
            raise PermissionDenied(f"name: regions are for callers on the daemon's host (a unix socket or loopback); "
                                   f"this call came from {peer}")
        kind = request.WhichOneof("source") or ""
        self.regions.register(session_of(context), request.name, {"shm_key": "shm"}.get(kind, kind),
                              request.shm_key, request.offset, request.byte_size, request.cuda_ipc)
        return pb.RegisterRegionResponse()

    def UnregisterRegion(self, request: pb.UnregisterRegionRequest, context) -> pb.UnregisterRegionResponse:
        """Releases one region of the session, or all of them (an empty name).

        Example:
            >>> from types import SimpleNamespace
            >>> rpcs = RegionService(RegionTable())
            >>> session = rpcs.regions.open_session()
            >>> context = SimpleNamespace(invocation_metadata=lambda: [("x-xreduce-session", session.id)])
            >>> rpcs.UnregisterRegion(pb.UnregisterRegionRequest(name="in"), context)
            Traceback (most recent call last):
            ...
            xreduced.errors.NotFound: name: no region 'in' in this session; it has none
        """
        self.regions.unregister(session_of(context), request.name)
        return pb.UnregisterRegionResponse()

    def ListRegions(self, request: pb.ListRegionsRequest, context) -> pb.ListRegionsResponse:
        """The session's regions, by name.

        Example:
            >>> from types import SimpleNamespace
            >>> rpcs = RegionService(RegionTable())
            >>> session = rpcs.regions.open_session()
            >>> context = SimpleNamespace(invocation_metadata=lambda: [("x-xreduce-session", session.id)])
            >>> len(rpcs.ListRegions(pb.ListRegionsRequest(), context).regions)
            0
        """
        return pb.ListRegionsResponse(regions=[
            pb.Region(name=r.name, kind=r.kind, shm_key=r.key if r.kind == "shm" else "", offset=r.offset,
                      byte_size=r.byte_size, in_use=r.in_use)
            for r in self.regions.list(session_of(context))
        ])
