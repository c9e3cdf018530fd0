"""The identity of a full KV block: a hash chained over its parent's hash and its token ids.

Shared by the KV-cache manager (prefix caching) and the prefix-aware replica router, so a router
can predict which replica already holds a prompt's blocks. Python's hash of a tuple of ints is
deterministic across processes (hash randomisation only touches str/bytes), which lets separate
engine processes and the gateway agree on block identities.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenpath.engine.digests import blake2b

ROOT_HASH = 0x5EED


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    return hash((ROOT_HASH if parent_hash is None else parent_hash, tuple(token_ids)))


def lora_root(name: str, path: str) -> int:
    """The chain's root for a request run with a LoRA adapter: its blocks hold other K/V than the
    base model's for the same tokens, so they must never match them (nor another adapter's).
    A stable digest, not `hash(str)`, which differs between processes."""
    return int.from_bytes(blake2b(f"lora\0{name}\0{path}".encode(), digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None,
                 root: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (the last partial block has none);
    `root`: the chain's parent before the first block (`lora_root`), None for the base model."""
    n_full = len(token_ids) // block_size
    if limit is not None:
        n_full = min(n_full, limit)
    out: list[int] = []
    parent: int | None = root
    for i in range(n_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
