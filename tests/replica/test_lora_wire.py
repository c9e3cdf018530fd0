"""The adapter crosses the engine link on the request (one field of the one codec), and the load a
request waited for comes back in its engine events, shifted into the gateway's clock; a request
without an adapter, or from an engine that predates them, decodes as before."""

from __future__ import annotations

from tokenpath.protocol import EngineEvents, GenerateRequest, RequestOutput, SamplingParams
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.wire import decode_output, decode_request, encode_output, encode_request


def test_request_carries_its_adapter():
    req = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), lora=LoraRef("sql", "/a/sql", base="m"))
    back = decode_request(encode_request(req))
    assert back.lora == LoraRef("sql", "/a/sql")  # (the base is the gateway's business)
    plain = encode_request(GenerateRequest("r2", [1], SamplingParams()))
    assert decode_request(plain).lora is None
    del plain["lora"]  # an older gateway
    assert decode_request(plain).lora is None


def test_load_time_comes_back_in_the_events():
    req = GenerateRequest("r1", [1, 2], SamplingParams())
    out = RequestOutput("r1", [], [1, 2], 0, True, EngineEvents(queued=1.0, lora_load=[1.5, 1.75, True]))
    ev = decode_output(encode_output(out), req).events
    assert ev.lora_load == [1.5, 1.75, True]
    assert ev.shifted(10.0).lora_load == [11.5, 11.75, True]
    assert ev.snapshot().lora_load == [1.5, 1.75, True]
    older = encode_output(RequestOutput("r1", [], [1, 2], 0, True, EngineEvents(queued=1.0)))
    older["ev"] = older["ev"][:10]
    assert decode_output(older, req).events.lora_load is None
