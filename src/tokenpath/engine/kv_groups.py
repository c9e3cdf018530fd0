"""KV-cache groups: which layers share a block table, and how they share the block pool.

Why: a layer with a sliding window of W positions never reads a key more than W - 1 positions
behind its query, so a long request needs only its last ceil(W / block) + 1 blocks for such a
layer; a full-attention layer needs all of them. With one block table for every layer (one block
= one token range in every layer), Gemma 3 (5 windowed layers to each global one) keeps 18 layers
of KV for the whole context although 15 of them read only the last 512 positions.

The layout (vLLM V1's hybrid KV cache manager, written for this engine): layers are grouped by
their attention type (full, or window W), and each type's layers are cut into groups of the same
size S (the smallest type's layer count). The pool holds S tensor pairs (K, V), each of
`num_blocks * block_size` slots; layer j of every group uses pair j. A block id is therefore a
page of S layers, and any group can take any free block: one pool, one free list, one usage
figure, whatever the mix of short and long requests. Each sequence has one block table per group;
a window group's table keeps its length (positions stay aligned) but the entries of blocks that
fell wholly out of the window are NULL_BLOCK, their blocks given back to the pool.

A model with one attention type has one group of every layer: today's single table, unchanged.
`hybrid=False` also gives one group, the windows kept by the attention masks only (every layer's
KV for the whole context): the full-allocation baseline benchmarks/kv_window.py measures against.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenpath.engine.model_config import ModelConfig

NULL_BLOCK = -1  # a window group's table entry whose block was freed (read as block 0, masked out)


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: the pool tensor pair it uses (its index in its group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers per block: the pool's tensor pairs."""
        return max(self.layer_slot) + 1

    @staticmethod
    def single(num_layers: int) -> KVLayout:
        return KVLayout((None,), (0,) * num_layers, tuple(range(num_layers)))

    @staticmethod
    def for_model(cfg: ModelConfig, hybrid: bool = True) -> KVLayout:
        by_type: dict[int | None, list[int]] = {}
        for layer in range(cfg.num_layers):
            by_type.setdefault(cfg.window(layer), []).append(layer)
        if not hybrid:  # one table for the whole context; the windows stay in the masks
            return KVLayout.single(cfg.num_layers)
        size = min(len(layers) for layers in by_type.values())
        windows: list[int | None] = []
        layer_group = [0] * cfg.num_layers
        layer_slot = [0] * cfg.num_layers
        # Full groups first: group 0 is then the full-attention table when there is one (the
        # prefix-cache index routers read, and the table `Sequence.block_table` shows).
        for window in sorted(by_type, key=lambda w: (w is not None, w or 0)):
            layers = by_type[window]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_group[layer], layer_slot[layer] = len(windows), slot
                windows.append(window)
        return KVLayout(tuple(windows), tuple(layer_group), tuple(layer_slot))
