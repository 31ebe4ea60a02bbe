"""The nudge's wire format and listener: what a leader accepts, and what it ignores."""

from __future__ import annotations

import socket
import time

from apsup.supervisor.nudge import MAX_DATAGRAM, NudgeListener, decode, encode


def test_a_nudge_names_a_family_and_one_scope() -> None:
    assert decode(encode("topic-memory", "scope/1")) == ("topic-memory", "scope/1")
    long_scope = "x" * (MAX_DATAGRAM + 10)  # too long to name: the family alone
    assert decode(encode("fam", long_scope)) == ("fam", "")
    for junk in (b"", b"GET / HTTP/1.1\r\n", b"apsup-nudge1\0", b"apsup-nudge1\0\xff\xfe\0s"):
        assert decode(junk) is None


def test_the_listener_drains_deduplicated_nudges_and_drops_junk() -> None:
    listener = NudgeListener("127.0.0.1", 0)
    port = listener.sock.getsockname()[1]
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for data in (encode("a", "s1"), encode("a", "s1"), b"junk", encode("b", "s2")):
            sender.sendto(data, ("127.0.0.1", port))
        got: list[tuple[str, str]] = []
        for _ in range(50):
            got += listener.drain()
            if len(got) >= 2:
                break
            time.sleep(0.01)  # datagrams on loopback arrive at once; be patient anyway
        assert sorted(set(got)) == [("a", "s1"), ("b", "s2")]
        assert listener.drain() == []  # nothing left, and no error on an empty queue
    finally:
        sender.close()
        listener.close()
