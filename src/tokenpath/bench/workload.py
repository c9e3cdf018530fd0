"""Seeded, locally generated workloads: the same request list for every target of a run.

Request `i` of load point `k` is a pure function of (seed, k, i), so a run can draw as many
requests as a duration needs and every target gets the same prompts. The seed is drawn afresh for
each invocation unless `--seed` is given: the same prompts sent twice to one server measure its
prefix cache, not its prefill (a second run went from 10% to 91% cache hits). For the same reason
each load point of a sweep gets its own prompts.

Prompt lengths (`input_len_mode`): `template` (the default) counts the whole prompt the server
tokenizes, chat template included, so `usage.prompt_tokens` matches --input-len; `user` counts the
user text only, as aiperf's ISL does, so the server sees a few template tokens more.

- random: each request a fresh prompt of `input_len` tokens (template included, when known).
- shared-prefix: K groups, each with a long common system prompt of `prefix_len` tokens; every
  request adds its own `input_len`-token suffix. Exercises prefix caching and prefix-aware routing.
- multi-turn: sessions that resend their growing history (earlier user turns and the replies the
  target actually gave) with a new `input_len`-token user message each turn.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tokenpath.bench.records import RequestSpec
from tokenpath.bench.tokens import TokenCounter

WorkloadKind = Literal["random", "shared-prefix", "multi-turn"]
WORKLOAD_KINDS: tuple[str, ...] = ("random", "shared-prefix", "multi-turn")
SHARES_PREFIXES = ("shared-prefix", "multi-turn")  # workloads whose cache hits are the point
InputLenMode = Literal["template", "user"]
INPUT_LEN_MODES: tuple[str, ...] = ("template", "user")


@dataclass(frozen=True)
class LengthDist:
    """A token length: fixed (`256`), `uniform:LO:HI` (inclusive) or `normal:MEAN:STD` (clipped to >= 1)."""

    kind: Literal["fixed", "uniform", "normal"] = "fixed"
    a: float = 128
    b: float = 0

    @classmethod
    def parse(cls, text: str | int) -> LengthDist:
        parts = str(text).strip().lower().split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            if len(parts) == 3 and parts[0] in ("uniform", "normal"):
                d = cls(parts[0], float(parts[1]), float(parts[2]))  # type: ignore[arg-type]
                if d.kind == "uniform" and not 1 <= d.a <= d.b:
                    raise ValueError
                if d.kind == "normal" and (d.a < 1 or d.b < 0):
                    raise ValueError
                return d
        except ValueError:
            pass
        raise ValueError(f"bad length {text!r}: use N, uniform:LO:HI or normal:MEAN:STD")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return max(1, int(self.a))
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        return str(int(self.a)) if self.kind == "fixed" else f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class WorkloadConfig:
    kind: WorkloadKind = "random"
    input_len: LengthDist = LengthDist("fixed", 256)
    output_len: LengthDist = LengthDist("fixed", 128)
    seed: int = 0
    prefix_groups: int = 4
    prefix_len: int = 1024
    turns: int = 4
    sessions: int = 8
    input_len_mode: InputLenMode = "template"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["input_len"], d["output_len"] = str(self.input_len), str(self.output_len)
        return d


class Workload:
    """Generates `RequestSpec`s on demand; deterministic in (seed, index)."""

    def __init__(self, config: WorkloadConfig, tokens: TokenCounter, api: str = "chat", stream: int = 0) -> None:
        self.config = config
        self.tokens = tokens
        self.api = api
        self.stream = stream  # the load point: each gets its own prompts (shared prefixes stay shared)
        self._prefixes: dict[int, str] = {}

    def for_point(self, k: int) -> Workload:
        """The same workload with load point `k`'s own prompts."""
        return Workload(self.config, self.tokens, self.api, stream=k)

    def _rng(self, *key: object) -> random.Random:
        # Hash the key: Mersenne Twister seeded with near-identical strings gives correlated first draws.
        salt = (self.config.seed,) if self.stream == 0 else (self.config.seed, f"point{self.stream}")
        digest = hashlib.sha256(":".join(str(k) for k in (*salt, *key)).encode()).digest()
        return random.Random(int.from_bytes(digest[:16], "big"))

    def _template(self, with_system: bool) -> int:
        return self.tokens.chat_overhead(with_system) if self.api == "chat" else 0

    def _overhead(self, with_system: bool) -> int:
        """Template tokens taken out of --input-len (none when lengths count the user text only)."""
        return self._template(with_system) if self.config.input_len_mode == "template" else 0

    def prefix(self, group: int) -> str:
        if group not in self._prefixes:  # shared across load points: sharing is what this workload tests
            rng = random.Random(int.from_bytes(hashlib.sha256(f"{self.config.seed}:prefix:{group}".encode())
                                               .digest()[:16], "big"))
            self._prefixes[group] = self.tokens.text_of_len(rng, self.config.prefix_len)
        return self._prefixes[group]

    def spec(self, index: int) -> RequestSpec:
        """Request `index` of the measured run."""
        c = self.config
        rng = self._rng("req", index)
        in_len, out_len = c.input_len.sample(rng), c.output_len.sample(rng)
        if c.kind == "shared-prefix":
            group = rng.randrange(max(1, c.prefix_groups))
            total = c.prefix_len + in_len + self._template(True)
            return RequestSpec(index, total, out_len, self.tokens.text_of_len(rng, in_len),
                               system_text=self.prefix(group), group=group)
        user_len = max(1, in_len - self._overhead(False))
        total = user_len + self._template(False)  # what the server should count
        if c.kind == "multi-turn":
            session, turn = self.session_of(index)
            return RequestSpec(index, total, out_len, self.tokens.text_of_len(rng, user_len),
                               session=session, turn=turn)
        return RequestSpec(index, total, out_len, self.tokens.text_of_len(rng, user_len))

    def warmup_spec(self, k: int) -> RequestSpec:
        """Warm-up request `k`: single-turn and without the shared prefixes, so it warms the server
        (allocations, lazy setup) without pre-filling the caches the measured run is about."""
        rng = self._rng("warmup", k)
        in_len, out_len = self.config.input_len.sample(rng), self.config.output_len.sample(rng)
        user_len = max(1, in_len - self._overhead(False))
        return RequestSpec(-1 - k, user_len + self._template(False), out_len, self.tokens.text_of_len(rng, user_len))

    def session_of(self, index: int) -> tuple[int, int]:
        """(session, turn) of request `index`: `sessions` slots run side by side, interleaved, so a
        turn's predecessor was issued `sessions` requests earlier; a slot opens a new session
        after `turns` turns. Interleaving keeps closed-loop clients from all waiting on one chain."""
        s, t = max(1, self.config.sessions), max(1, self.config.turns)
        slot, rnd = index % s, index // s
        return slot + s * (rnd // t), rnd % t
