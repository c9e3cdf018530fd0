"""The `out` frame's positional rows (protocol/rows.py): declared by the dataclasses' field order,
only ever appended to, round-tripped whole through a real msgpack frame, and tolerant of a peer
that knows fewer or more fields."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from tokenpath.protocol import GenerateRequest, SamplingParams
from tokenpath.protocol.outputs import (
    CompletionOutput,
    EngineEvents,
    GrammarStats,
    RequestOutput,
    TokenLogprob,
)
from tokenpath.protocol.rows import ROW_TYPES, from_row, to_row
from tokenpath.protocol.wire import FrameError, OutputFrames, _unpack, decode_output, encode_output, pack

# The wire order as released: each class's fields must start with these, in this order (a field
# is appended, never inserted, renamed or moved: a peer of another version reads rows by position).
RELEASED = {
    TokenLogprob: ["token_id", "token", "logprob", "top", "rank"],
    CompletionOutput: ["index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason"],
    EngineEvents: ["queued", "scheduled", "first_token", "finished", "prefill_chunks", "behind", "freed_by",
                   "stalls", "preempted", "traced", "lora_load", "spec"],
    GrammarStats: ["compile_ms", "cache_hit", "mask_us_per_token"],
}


def test_rows_only_ever_grow_at_the_end():
    assert set(RELEASED) == set(ROW_TYPES)
    for cls, released in RELEASED.items():
        fields = [f.name for f in dataclasses.fields(cls)]
        assert fields[:len(released)] == released, f"{cls.__name__}: reordered or renamed on the wire"
        added = dataclasses.fields(cls)[len(released):]
        assert all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                   for f in added), f"{cls.__name__}: a field appended without a default"


def full_output() -> RequestOutput:
    lp = TokenLogprob(5, "a", -0.5, [(5, "a", -0.5), (6, "b", -1.25)])
    events = EngineEvents(1.0, 2.0, 3.0, 4.0, [(2.0, 16), (2.5, 8)], [["r1", "t", 32, "engine-0"]], "r9",
                          [[2.2, 0.3, [["r1", 4]]]], [[2.4, "r2", 12, 2.6]], True, [1.5, 1.9, True], [3, 9, 6])
    return RequestOutput("req-1", [CompletionOutput(0, "ab", [5, 6], [lp, lp], "stop", "</s>"),
                                   CompletionOutput(1, "c", [7], None, "length", 42)],
                         [1, 2, 3], 2, True, events, 1, grammar=GrammarStats(12.5, False, 3.25),
                         prompt_logprobs=[None, TokenLogprob(2, "x", -2.0, [(2, "x", -2.0)], 1)])


def test_a_full_output_round_trips_through_a_real_frame():
    out = full_output()
    request = GenerateRequest("req-1", [1, 2, 3], SamplingParams())
    got = decode_output(_unpack(memoryview(pack(encode_output(out)))[4:]), request)
    assert got == out  # every field, tuples where the types say tuples


def test_a_row_is_its_fields_in_order_and_the_sender_keeps_its_own_lists():
    ev = EngineEvents(1.0, 2.0, 3.0)
    assert to_row(ev) == [1.0, 2.0, 3.0, None, [], [], None, [], [], False, None, None]
    assert from_row(EngineEvents, [1.0, 2.0, 3.0]) == ev  # (a shorter row: the rest at their defaults)
    ev.prefill_chunks.append((2.0, 4))
    sent = to_row(ev)
    ev.prefill_chunks.append((2.5, 4))  # (the engine appends in place after sending)
    assert sent[4] == [[2.0, 4]]


def test_a_peer_with_fewer_or_more_fields_is_read():
    assert from_row(TokenLogprob, [5, "a", -0.5, []]).rank is None  # an older peer: no rank
    assert from_row(GrammarStats, [1.0, True, 2.0, "a field of a newer version"]) == GrammarStats(1.0, True, 2.0)


def test_unchanged_events_are_sent_once():
    frames, out = OutputFrames(), full_output()
    assert frames.encode(out)["ev"] is not None
    assert frames.encode(out)["ev"] is None


@pytest.mark.parametrize("bad", [{"ev": "soon"}, {"outs": [[0, "a", 7]]}, {"outs": [5]}, {"gr": [1.0]}])
def test_a_malformed_output_frame_is_a_frame_error_naming_the_request(bad):
    d = msgpack.unpackb(msgpack.packb(encode_output(full_output())))
    d.update(bad)
    with pytest.raises(FrameError, match="req-1"):
        decode_output(d, GenerateRequest("req-1", [1, 2, 3], SamplingParams()))
