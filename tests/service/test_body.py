"""``BodyBuffer``: a body held once, in one buffer, released when refused or handed over."""
from __future__ import annotations

import sys

import pytest

from service.body import BodyBuffer

CHUNKS = [b'{"inputs": ', b'"hello"', b"}"]


@pytest.mark.parametrize("size_hint", [None, sum(map(len, CHUNKS))])
def test_chunks_land_in_one_buffer_handed_over_once(size_hint):
    buffer = BodyBuffer(limit=100, size_hint=size_hint)
    assert buffer.preallocated is (size_hint is not None)
    assert all(buffer.add(chunk) for chunk in CHUNKS)
    body = buffer.take()
    assert body == b"".join(CHUNKS) and isinstance(body, bytearray)
    assert sys.getrefcount(body) == 2  # this name and getrefcount's argument: the buffer kept no reference
    assert buffer.take() == b""


def test_a_preallocated_body_that_ends_short_is_cut_to_what_arrived():
    buffer = BodyBuffer(limit=100, size_hint=50)
    buffer.add(b"abc")
    assert buffer.take() == b"abc"


def test_over_the_limit_the_buffer_is_released():
    buffer = BodyBuffer(limit=10)
    assert buffer.add(b"x" * 8)
    assert not buffer.add(b"x" * 3)
    assert buffer.size == 11 and buffer.take() == b""


def test_discarded_chunks_are_counted_not_kept():
    buffer = BodyBuffer(limit=10)
    assert buffer.discard(b"x" * 10) and not buffer.discard(b"x")
    assert buffer.size == 11 and buffer.take() == b""
