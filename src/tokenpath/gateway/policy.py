"""The optional pre-request content-policy hook.

A policy looks at the request's texts before any work is queued and returns a reason to refuse,
or None. The gateway turns a reason into a 400 `content_policy_violation`. Off by default.
A policy is any object with `async check(principal, texts) -> str | None`; operators plug their
own in with `module:attribute` (an instance, or a class / factory called without arguments).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenpath.gateway.base import Principal


@runtime_checkable
class PolicyHook(Protocol):
    async def check(self, principal: Principal, texts: list[str]) -> str | None: ...


class DenyListPolicy:
    """Refuses a request in which any listed word or phrase appears (case-insensitive, whole words).

    The refusal does not quote the matched text back: the message names the policy, not the input.
    """

    def __init__(self, phrases: Iterable[str]) -> None:
        cleaned = sorted({p.strip().lower() for p in phrases if p.strip()})
        if not cleaned:
            raise ValueError("a deny list needs at least one phrase")
        self._pattern = re.compile(r"(?<!\w)(?:" + "|".join(re.escape(p) for p in cleaned) + r")(?!\w)",
                                   re.IGNORECASE)

    @classmethod
    def from_file(cls, path: str | Path) -> DenyListPolicy:
        """One phrase a line; blank lines and lines starting with '#' are ignored."""
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        return cls(line for line in lines if not line.lstrip().startswith("#"))

    async def check(self, principal: Principal, texts: list[str]) -> str | None:
        if any(self._pattern.search(text) for text in texts):
            return "The request was rejected by the content policy (deny list)."
        return None


def load_policy(spec: str | PolicyHook | None) -> PolicyHook | None:
    """None, a PolicyHook, `deny-list:PATH`, or `module:attribute`."""
    if spec is None or isinstance(spec, PolicyHook):
        return spec
    if spec.startswith("deny-list:"):
        return DenyListPolicy.from_file(spec.removeprefix("deny-list:"))
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"policy must be 'deny-list:PATH' or 'module:attribute', got {spec!r}")
    obj = getattr(importlib.import_module(module_name), attr)
    hook = obj if isinstance(obj, PolicyHook) else obj()
    if not isinstance(hook, PolicyHook):
        raise TypeError(f"{spec} is not a policy: it needs an async check(principal, texts) method")
    return hook
