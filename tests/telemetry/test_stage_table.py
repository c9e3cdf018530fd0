"""One stage table: `telemetry.timeline.STAGE_BOUNDS` names the request path's stages and the
events that bound them; every Timeline stamp in src is one of `EVENTS`; no other module writes
its own list of stage names (metrics, the dashboard, diagnose and benchmarks read the table)."""

from __future__ import annotations

import re
from pathlib import Path

from tokenpath.api.dashboard import _page
from tokenpath.telemetry.stages import current_stage
from tokenpath.telemetry.timeline import EVENTS, PATH_STAGES, STAGE_BOUNDS, STAGES, Timeline

SRC = Path(__file__).resolve().parents[2] / "src" / "tokenpath"


def sources() -> dict[Path, str]:
    return {p: p.read_text() for p in [*SRC.rglob("*.py"), *SRC.rglob("*.html")]}


def test_the_table_is_bounded_by_events_in_path_order():
    assert (*PATH_STAGES, "total") == STAGES
    ends = [EVENTS.index(end) for _, _, end in STAGE_BOUNDS]
    assert ends == sorted(ends) and STAGE_BOUNDS[-1][2] == "finished"
    for (_, _, end), (_, start, _) in zip(STAGE_BOUNDS, STAGE_BOUNDS[1:], strict=False):
        assert end == start, "each stage starts where the one before it ends"


def test_every_stamp_in_src_is_a_known_event():
    stamped = {m for text in sources().values() for m in re.findall(r"\.stamp\(\s*\"([a-z_]+)\"", text)}
    events = (SRC / "replica" / "events.py").read_text()  # (the engine's events, stamped from a tuple)
    loop = re.search(r"for name, at in \((.*?)\):\n", events, re.S)
    assert loop, "replica/events.py stamps its engine events from one tuple"
    stamped |= set(re.findall(r"\(\"([a-z_]+)\", ", loop.group(1)))
    assert {"admitted", "tokenized", "scheduled", "first_token", "finished"} <= stamped
    assert stamped - set(EVENTS) == set(), "stamped but not in timeline.EVENTS"


# Events with one owner: a stamp of one anywhere else is a second owner, and since the first stamp
# wins, one of the two is silently never recorded (as admission's `admitted` once was, behind the
# API's). `routed` has two writers on purpose, see their call sites; `finished` has two roles: the
# replica boundary stamps the receipt of a request's last output, and `RequestRun.done` ends every
# request that has none.
OWNERS = {"body_read": {"api/run.py"}, "authenticated": {"api/intake.py"}, "tokenized": {"api/intake.py"},
          "admitted": {"admission/controller.py"}, "dequeued": {"admission/controller.py"},
          "dispatched": {"admission/controller.py"}, "finished": {"api/run.py", "replica/events.py"}}


def test_each_owned_event_is_stamped_by_its_owner_alone():
    writes = r"\.stamp\(\s*\"([a-z_]+)\"|\bstamps\[\s*\"([a-z_]+)\"\s*\]\s*=(?!=)"
    writers: dict[str, set[str]] = {}
    for p, text in sources().items():
        for call, item in re.findall(writes, text):
            writers.setdefault(call or item, set()).add(str(p.relative_to(SRC)))
    writers["finished"] = writers.get("finished", set()) | {"replica/events.py"}  # (stamped from its tuple)
    assert {e: writers.get(e) for e in OWNERS} == OWNERS


def test_no_second_list_of_stage_names():
    pair = "|".join(rf"[\"']{a}[\"']\s*,\s*[\"']{b}[\"']" for a, b in zip(PATH_STAGES, PATH_STAGES[1:], strict=False))
    copies = [str(p.relative_to(SRC)) for p, text in sources().items()
              if p.name != "timeline.py" and re.search(pair, text)]
    assert copies == [], copies


def test_the_dashboard_draws_the_tables_stages():
    assert f"const STAGES = {list(PATH_STAGES)!r}".replace("'", '"') in _page("dashboard.html")


def test_current_stage_walks_the_table():
    t = Timeline("r")
    seen = [current_stage(t)]
    for _, _, end in STAGE_BOUNDS:
        t.stamp(end)
        if end == "first_token":
            t.stamp("first_reasoning")  # (a reply that thinks: the reasoning stage is its own)
        if end == "body_read":
            t.stamp("awaiting_model")  # (a request that waits for its model's load)
        seen.append(current_stage(t))
    assert seen == [*PATH_STAGES, "done"]


def test_a_reply_that_never_thought_has_no_reasoning_stage():
    """Without `first_reasoning`, decode runs from first_token; a reply that thought and was cut
    before answering is all reasoning; one that answered splits at first_answer."""
    def timeline(*events: str) -> Timeline:
        t = Timeline("r")
        at = t.stamps["received"]
        for i, e in enumerate(("body_read", "admitted", "dispatched", "scheduled", "first_token", *events)):
            t.stamp(e, at=at + i + 1)
        return t

    plain = timeline("finished")
    assert current_stage(timeline()) == "decode"
    assert "reasoning" not in plain.durations() and plain.durations()["decode"] == 1
    cut = timeline("first_reasoning", "finished")
    assert "decode" not in cut.durations() and cut.durations()["reasoning"] == 2
    assert current_stage(timeline("first_reasoning")) == "reasoning"
    both = timeline("first_reasoning", "first_answer", "finished").durations()
    assert (both["reasoning"], both["decode"]) == (2, 1)
    assert sum(v for k, v in both.items() if k != "total") == both["total"]


def test_durations_kept_once_finished_follow_a_later_stamp():
    """`Timeline.durations` is kept once `finished` is stamped (a request's ending reads it ~9
    times), and computed afresh when a stamp comes after it; each caller gets its own dict."""
    from tokenpath.telemetry.timeline import Timeline

    t = Timeline("r", stamps={"received": 10.0})
    t.stamp("admitted", at=10.1)
    t.stamp("finished", at=11.0)
    first = t.durations()
    assert {k: round(v, 6) for k, v in first.items()} == {"gateway": 0.1, "queue": 0.9, "total": 1.0}
    first["total"] = 99.0  # (a caller's change is its own)
    assert t.durations()["total"] == 1.0
    t.stamp("dispatched", at=10.5)  # (a stamp after `finished`: the kept figures are not reused)
    again = t.durations()
    assert {k: round(v, 6) for k, v in again.items()} == {"gateway": 0.1, "queue": 0.4, "engine_queue": 0.5,
                                                         "total": 1.0}
