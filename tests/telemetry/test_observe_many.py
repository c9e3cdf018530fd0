"""`observe_many` (telemetry/metrics.py): a request's inter-token gaps counted into a histogram one
update per bucket give the exposition value-by-value `observe` gives: every bucket, count and sum,
values on a bucket's bound included (issue 37)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tokenpath.telemetry.metrics import observe_many

BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 1.0)
VALUES = [0.0, 0.0005, 0.001, 0.001, 0.0049, 0.005, 0.02, 0.1, 0.7, 3.0, 250.0, 0.01]


def _exposition(fill) -> list[str]:  # noqa: ANN001
    """The samples' lines, less `_created` (the moment the histogram was made)."""
    registry = CollectorRegistry()
    hist = Histogram("gap_seconds", "gaps", ["model"], buckets=BOUNDS, registry=registry)
    fill(hist.labels("m"))
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_observe_many_counts_as_observe_does():
    one_by_one = _exposition(lambda child: [child.observe(v) for v in VALUES])
    assert _exposition(lambda child: observe_many(child, VALUES)) == one_by_one
    assert _exposition(lambda child: observe_many(child, [])) == _exposition(lambda child: None)


class _Plain:
    """A histogram-like child with no bucket list: observed value by value."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def observe(self, v: float) -> None:
        self.seen.append(v)


def test_observe_many_falls_back_to_observe():
    child = _Plain()
    observe_many(child, [0.5, 0.25])
    assert child.seen == [0.5, 0.25]
