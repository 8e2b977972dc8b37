"""Wire format between the clock client's transports and the controller."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus_megatron.runtime.clock.wire import (
    CODE_MARK,
    NO_TIME,
    FrameReader,
    begin_record,
    encode_control,
    encode_records,
)


def test_wire_format_round_trip_in_any_chunks():
    t = time.monotonic()
    items = [
        [*begin_record(t, 3, 2, 1200, "forward", t - 1e-3), *begin_record(t, 3, 3, 990, "backward")],
        {"op": "reset", "seq": 7},
        [CODE_MARK, t, NO_TIME, 5.0, 1.0, 0.0, 0.0, 0.0],
        {"op": "answer"},
    ]
    data = b"".join(encode_records(i) if isinstance(i, list) else encode_control(i) for i in items)
    for step in (1, 3, 8, 57, len(data)):  # however the pipe splits the stream
        reader, got = FrameReader(), []
        for k in range(0, len(data), step):
            got += reader.feed(data[k : k + step])
        assert [list(g) if not isinstance(g, dict) else g for g in got] == [
            [x if x == x else pytest.approx(x, nan_ok=True) for x in i] if isinstance(i, list) else i for i in items
        ]
    with pytest.raises(ValueError, match="unknown clock controller message"):
        FrameReader().feed(b"x 1 2\n")


_record = st.tuples(
    st.sampled_from([1.0, 2.0, 3.0]),
    st.floats(0, 1e6),
    st.one_of(st.just(NO_TIME), st.floats(0, 1e6)),
    st.integers(0, 10_000),
    st.integers(0, 500),
    st.integers(0, 2000),
    st.integers(0, 1),
    st.one_of(st.just(NO_TIME), st.floats(0, 1e3)),
)
_control = st.fixed_dictionaries({"op": st.sampled_from(["answer", "reset", "close"]), "seq": st.integers(0, 10**9)})


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.one_of(st.lists(_record, min_size=1, max_size=5), _control), max_size=8),
    cuts=st.lists(st.integers(1, 400), max_size=12),
)
def test_frame_reader_reassembles_any_split(items, cuts):
    """Whatever chunks the pipe delivers, the reader returns the same blocks and control messages."""
    data = b"".join(
        encode_records([x for r in i for x in r]) if isinstance(i, list) else encode_control(i) for i in items
    )
    reader, got, pos = FrameReader(), [], 0
    for n in cuts + [len(data)]:
        got += reader.feed(data[pos : pos + n])
        pos += n
    assert pos >= len(data) and reader.feed(b"") == []
    want = [[x for r in i for x in r] if isinstance(i, list) else i for i in items]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, dict):
            assert g == w
        else:
            assert [x for x in g if x == x] == [x for x in w if x == x]  # NaN != NaN: compare the rest
            assert [x != x for x in g] == [x != x for x in w]


@pytest.mark.parametrize("bad", [b"x 1 2\n", b"R 1\n" + bytes(64) + b"garbage\n", b"R -3\n", b"R two\n"])
def test_frame_reader_rejects_unknown_lines(bad):
    with pytest.raises(ValueError, match="clock controller message"):
        FrameReader().feed(bad)
