"""The daemon builds each part once and hands the same one to every part that uses it."""

from __future__ import annotations

from xreduced.config import Config
from xreduced.server import Daemon


def test_every_part_is_built_once_and_shared():
    d = Daemon(Config(listen="127.0.0.1:0", virtual_devices=2))
    try:
        s = d.service
        assert (s.rendezvous, s.prepared, s.admission, s.stats, s.regions, s.peers) == (
            d.rendezvous, d.prepared, d.admission, d.stats, d.regions, d.peers)
        assert (d.pipeline.stats, d.pipeline.admission, d.pipeline.regions) == (d.stats, d.admission, d.regions)
        assert d.express is not None and d.lane is None  # the lane opens at start, on the bound address
        assert s.collectives_waiting() == 0 and s.lane() is None
    finally:
        d.stop(grace=0)


def test_without_a_local_lane_there_is_no_express_lane():
    d = Daemon(Config(listen="127.0.0.1:0", virtual_devices=2, local_lane=False))
    try:
        assert d.express is None and d.service.collectives_waiting() == 0
    finally:
        d.stop(grace=0)
