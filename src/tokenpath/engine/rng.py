"""The sampler's random source: uniforms in [0, 1) from a seeded Mersenne Twister, without torch.

Why this form: the engine drew its uniforms with `torch.rand(1, dtype=float64, generator=g)` on a
`torch.Generator().manual_seed(seed)`, and a request's `seed` promises the same tokens on every
run, across versions. torch's CPU generator is the reference MT19937 seeded with the seed's low 32
bits (init_genrand), and a float64 uniform is two 32-bit outputs r1, r2 joined as r1 << 32 | r2,
whose low 53 bits scaled by 2**-53 are the value. Python's `random.Random` is the same generator
(its `getrandbits(32)` is one genrand_int32 output) once its state is set to init_genrand's, so
this class gives bit for bit the uniforms torch gave (tests/engine/test_sampler_draw.py checks it
against torch where torch is installed, and against numpy's MT19937 with its legacy seeding) and
the native GGUF path needs no torch at all (issue 42: torch's import alone is ~218 MiB of RSS).
Not numpy's MT19937: `numpy.random` is 2.3 MiB resident that nothing else in the engine imports,
while `random` is already loaded (pydantic imports it).
"""

from __future__ import annotations

import random

_LOW53 = (1 << 53) - 1
_SCALE = 2.0**-53
_N = 624  # MT19937's state words


def _init_genrand(seed: int) -> tuple[int, ...]:
    """MT19937's reference seeding of a 32-bit seed: its 624 state words (Matsumoto and Nishimura's init_genrand)."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, _N):
        prev = mt[-1]
        mt.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return tuple(mt)


class Generator:
    """A seeded stream of float64 uniforms in [0, 1), the values of torch's CPU generator."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._bits: random.Random | None = None  # seeded at the first draw: a greedy request never draws

    def uniform(self) -> float:
        """The next uniform (one `torch.rand(1, dtype=torch.float64)` of the same seed)."""
        bits = self._bits
        if bits is None:  # ~0.2-0.4 ms of Python, once per generator that draws
            bits = self._bits = random.Random()
            # (version 3, the words and the position 624: the next output first regenerates the
            # words, as init_genrand leaves it; no cached Gaussian)
            bits.setstate((3, (*_init_genrand(self._seed), _N), None))
        r1 = bits.getrandbits(32)
        r2 = bits.getrandbits(32)
        return ((r1 << 32 | r2) & _LOW53) * _SCALE
