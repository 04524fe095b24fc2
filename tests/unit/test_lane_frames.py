"""The local lane's frames (xreduce.wire.lane) and the daemon's connection state, on real socket pairs."""

from __future__ import annotations

import math
import socket
import struct
import threading

import pytest
from xreduce.wire import lane as frames
from xreduced.lane import LaneConnection, LaneContext, lane_address


def test_a_hello_carries_the_session_and_the_metadata():
    body = frames.hello("abc", (("authorization", "Bearer t"), ("x", "y")))[4:]
    assert frames.read_hello(body) == ("abc", (("authorization", "Bearer t"), ("x", "y")))


@pytest.mark.parametrize("body, message", [
    (b"GET / HTTP/1.1\r\n", "lane hello: must start with b'XRL1'; got b'GET '"),
    (b"XRL1{not json", "lane hello: malformed (JSONDecodeError"),
    (b'XRL1{"metadata": []}', "lane hello: malformed (KeyError: 'session')"),
    (b'XRL1{"session": ""}', "lane hello: session must be a non-empty string; got ''"),
    (b'XRL1{"session": 7}', "lane hello: session must be a non-empty string; got 7"),
    (b'XRL1{"session": "s", "metadata": 3}', "lane hello: malformed (TypeError"),
])
def test_a_bad_hello_is_refused_naming_what_is_wrong(body, message):
    with pytest.raises(frames.FrameError) as e:
        frames.read_hello(body)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("method", frames.METHODS)
@pytest.mark.parametrize("timeout", [None, 0.25, 600.0])
def test_a_request_round_trips(method, timeout):
    body = frames.request(method, timeout, b"\x08\x01payload")[4:]
    assert frames.read_request(body) == (method, timeout, b"\x08\x01payload")


@pytest.mark.parametrize("body, message", [
    (b"\x01", "lane request: 1 bytes, shorter than its 9-byte header"),
    (struct.pack("<Bd", 3, 1.0), "lane request: method 3 is not one of 0..2 (Reduce, BatchReduce, Broadcast)"),
    (struct.pack("<Bd", 0, -1.0), "lane request: timeout must be >= 0 seconds; got -1.0"),
    (struct.pack("<Bd", 0, math.nan), "lane request: timeout must be >= 0 seconds; got nan"),
])
def test_a_bad_request_frame_is_refused_naming_what_is_wrong(body, message):
    with pytest.raises(frames.FrameError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        frames.read_request(body)


def test_a_reply_round_trips_and_a_short_one_is_refused():
    assert frames.read_reply(frames.reply(0, False, b"ok")[4:]) == (0, False, b"ok")
    assert frames.read_reply(frames.reply(14, True, b"stopping")[4:]) == (14, True, b"stopping")
    with pytest.raises(frames.FrameError, match="lane reply: 1 bytes"):
        frames.read_reply(b"\x00")


def test_frames_are_read_whole_across_many_sends_and_none_at_a_clean_end():
    a, b = socket.socketpair()
    big = bytes(range(256)) * 4096  # 1 MiB: larger than one recv
    sender = threading.Thread(target=lambda: (a.sendall(frames.frame(b"x")), a.sendall(frames.frame(big)),
                                              a.sendall(frames.frame(b"")), a.close()))
    sender.start()
    reader = frames.FrameReader(b)
    assert reader.read() == b"x"
    assert reader.read() == big
    assert reader.read() == b""
    assert reader.read() is None
    sender.join()


def test_frames_that_arrive_together_are_each_read():
    a, b = socket.socketpair()
    a.sendall(frames.frame(b"one") + frames.frame(b"two") + frames.frame(b"three")[:5])
    reader = frames.FrameReader(b)
    assert (reader.read(), reader.read()) == (b"one", b"two")
    a.sendall(frames.frame(b"three")[5:])
    assert reader.read() == b"three"


def test_a_frame_cut_short_or_too_long_is_an_error():
    a, b = socket.socketpair()
    a.sendall(struct.pack("<I", 10) + b"abc")
    a.close()
    with pytest.raises(ConnectionError, match=r"inside a frame \(3 of 10 bytes\)"):
        frames.FrameReader(b).read()
    a, b = socket.socketpair()
    a.sendall(struct.pack("<I", 0xFFFFFFFF))
    with pytest.raises(frames.FrameError, match="over the 2147483647-byte limit"):
        frames.FrameReader(b).read()
    a, b = socket.socketpair()
    a.sendall(b"\x01\x00")
    a.close()
    with pytest.raises(ConnectionError, match="inside a frame's length"):
        frames.FrameReader(b).read()


def test_addresses():
    assert frames.socket_address("unix:///run/x.lane") == "/run/x.lane"
    assert frames.socket_address("unix-abstract:n") == b"\0n"
    for bad in ("127.0.0.1:1", "unix:", "tcp:x"):
        with pytest.raises(ValueError, match="lane address: must be unix:PATH or unix-abstract:NAME"):
            frames.socket_address(bad)
    assert lane_address("unix:/tmp/d.sock") == "unix:/tmp/d.sock.lane"
    assert lane_address("unix:/" + "x" * 120).startswith("unix-abstract:")  # too long for a socket path
    assert lane_address("0.0.0.0:50551") != lane_address("0.0.0.0:50551")  # a fresh name per daemon


def test_a_frame_buffer_gives_whole_frames_as_their_bytes_arrive_in_any_pieces():
    data = frames.frame(b"one") + frames.frame(b"") + frames.frame(b"three" * 1000)
    for cut in (1, 3, 4, 5, 7, 50, len(data)):
        buffer, got = frames.FrameBuffer(), []
        for start in range(0, len(data), cut):
            buffer.push(data[start:start + cut])
            while (body := buffer.pop()) is not None:
                got.append(body)
        assert got == [b"one", b"", b"three" * 1000] and len(buffer) == 0, cut


def test_a_frame_buffer_refuses_a_length_over_the_limit():
    buffer = frames.FrameBuffer(struct.pack("<I", frames.MAX_FRAME_BYTES + 1))
    with pytest.raises(frames.FrameError, match="over the 2147483647-byte limit"):
        buffer.pop()


def test_a_connection_tells_its_call_when_the_caller_hangs_up_and_refuses_callbacks_after():
    connection = LaneConnection()
    context = connection.context = LaneContext("unix:lane pid=1", (), None, connection)
    left = threading.Event()
    assert context.add_callback(left.set) is True
    assert context.time_remaining() is None and context.is_active()
    connection.hung_up()
    assert left.is_set()
    assert not context.is_active()
    assert context.add_callback(lambda: None) is False  # as gRPC: the call has already ended
    context.end()
    assert LaneContext("unix:lane", (), 1.0, connection).add_callback(lambda: None) is False


def test_a_connection_sends_until_it_is_closed():
    a, b = socket.socketpair()
    connection = LaneConnection(a)
    assert connection.send(b"hi") is True and b.recv(2) == b"hi"
    connection.close()
    assert connection.send(b"late") is False


def test_a_lane_context_runs_its_callbacks_when_the_call_ends():
    context = LaneContext("unix:lane", (), 5.0, LaneConnection())
    ran = []
    context.add_callback(lambda: ran.append(1))
    context.end()
    assert ran == [1]
    context.set_trailing_metadata(())
    assert context.answered
