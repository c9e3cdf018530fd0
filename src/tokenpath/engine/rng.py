"""The sampler's random source: uniforms in [0, 1) from a seeded Mersenne Twister, without torch.

Why this form: the engine drew its uniforms with `torch.rand(1, dtype=float64, generator=g)` on a
`torch.Generator().manual_seed(seed)`, and a request's `seed` promises the same tokens on every
run, across versions. torch's CPU generator is the reference MT19937 seeded with the seed's low 32
bits (init_genrand), and a float64 uniform is two 32-bit outputs r1, r2 joined as r1 << 32 | r2,
whose low 53 bits scaled by 2**-53 are the value. numpy's MT19937 with its legacy 32-bit seeding
is the same generator, so this class gives bit for bit the uniforms torch gave
(tests/engine/test_sampler_draw.py checks it against torch where torch is installed) and the
native GGUF path needs no torch at all (issue 42: torch's import alone is ~218 MiB of RSS).
"""

from __future__ import annotations

import numpy as np

_LOW53 = (1 << 53) - 1
_SCALE = 2.0**-53


class Generator:
    """A seeded stream of float64 uniforms in [0, 1), the values of torch's CPU generator."""

    def __init__(self, seed: int = 0) -> None:
        self._bits = np.random.MT19937()
        self._bits._legacy_seeding(seed & 0xFFFFFFFF)

    def uniform(self) -> float:
        """The next uniform (one `torch.rand(1, dtype=torch.float64)` of the same seed)."""
        r1, r2 = (int(v) for v in self._bits.random_raw(2))
        return ((r1 << 32 | r2) & _LOW53) * _SCALE
