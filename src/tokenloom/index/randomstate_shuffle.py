"""``numpy.random.RandomState.shuffle``, same draws and same result, faster on large arrays.

RandomState's shuffle is a Fisher-Yates pass that interleaves each Mersenne Twister draw (with
rejection sampling, so unpredictable branches) with a swap at a random address (a cache miss).
The CPU can overlap few of those misses. This kernel reads the generator's state, makes a block
of draws first (by a rejection that does not branch on the words:
:mod:`tokenloom.index._randomstate_kernels`) and then does that block's swaps in a tight loop
where the misses overlap, and writes the advanced state back: the array and every later draw of
the RandomState are exactly what ``random_state.shuffle(array)`` would have given.

It needs numba (the kernels in :mod:`tokenloom.index._randomstate_kernels` compile on first use);
:func:`shuffle_like_randomstate` falls back to RandomState's own shuffle without it, and by default
below :data:`SMALL_SHUFFLE` elements.
"""

from __future__ import annotations

import numpy as np

from tokenloom.index import _randomstate_kernels
from tokenloom.index.kernels import compiled, numba_available

DRAW_BLOCK = 1 << 16
"""Fisher-Yates steps whose draws are made before their swaps (a 512 KiB buffer)."""
SMALL_SHUFFLE = 1 << 14
"""Elements below which :func:`shuffle_like_randomstate` keeps RandomState's own shuffle by
default: faster there. The kernel pays a fixed cost on every call to read and write the
generator's state, which RandomState's own shuffle does not, while a small array stays in cache,
so its swaps miss little and overlapping them gains little; the kernel's gain grows with the
array. A small build also needs no numba start-up (its import, in a new process)."""


_SAME_SIZE_INT = {4: np.dtype(np.int32), 8: np.dtype(np.int64)}


def _mt19937_state(random_state: np.random.RandomState):
    """The legacy state tuple, or None when the RandomState does not run on MT19937."""
    state = random_state.get_state(legacy=True)
    if not isinstance(state, tuple) or state[0] != "MT19937":
        return None
    return state


def _kernel_can_shuffle(array: np.ndarray) -> bool:
    return (array.ndim == 1 and array.flags.c_contiguous and array.flags.writeable
            and array.dtype.kind in "iuf" and array.dtype.isnative)


def fast_shuffle(random_state: np.random.RandomState, array: np.ndarray,
                 *, block: int = DRAW_BLOCK) -> None:
    """Shuffle the 1-D contiguous ``array`` in place exactly as ``random_state.shuffle`` does,
    advancing ``random_state`` by the same draws. Requires numba."""
    state = _mt19937_state(random_state)
    if state is None or not _kernel_can_shuffle(array):
        random_state.shuffle(array)  # anything unusual: RandomState's own path
        return
    name, key, position, has_gauss, cached_gaussian = state
    key = np.array(key, dtype=np.uint32)  # (624,) uint32, updated in place
    cursor = np.array([position], dtype=np.int64)
    # a shuffle only moves elements: shuffle 4- and 8-byte elements as int32 / int64, so a build's
    # document index (int32) and shuffle index (uint32) share one compiled kernel, loaded once
    moved = array.view(_SAME_SIZE_INT.get(array.dtype.itemsize, array.dtype))
    compiled(_randomstate_kernels.shuffle)(moved, key, cursor, max(1, int(block)))
    random_state.set_state((name, key, int(cursor[0]), has_gauss, cached_gaussian))


def interval_draws(random_state: np.random.RandomState, largest: int, count: int) -> np.ndarray:
    """``count`` draws in ``[0, largest]`` from the kernel's generator (for tests: they must equal
    ``random_state.randint(0, largest + 1, count, dtype=np.uint64)``)."""
    state = _mt19937_state(random_state)
    if state is None:
        raise ValueError("interval_draws needs a RandomState running on MT19937")
    name, key, position, has_gauss, cached_gaussian = state
    key = np.array(key, dtype=np.uint32)
    cursor = np.array([position], dtype=np.int64)
    out = compiled(_randomstate_kernels.intervals)(key, cursor, np.uint64(largest), int(count))
    random_state.set_state((name, key, int(cursor[0]), has_gauss, cached_gaussian))
    return out


def shuffle_like_randomstate(random_state: np.random.RandomState, array: np.ndarray,
                             *, fast: bool | None = None) -> None:
    """``random_state.shuffle(array)``, by the numba kernel when ``fast`` (default: when numba is
    installed and the array holds :data:`SMALL_SHUFFLE` elements or more); both give the same array
    and leave the same generator state."""
    if fast is None:
        fast = numba_available() and array.size >= SMALL_SHUFFLE
    if fast:
        fast_shuffle(random_state, array)
    else:
        random_state.shuffle(array)


__all__ = ["SMALL_SHUFFLE", "fast_shuffle", "interval_draws", "shuffle_like_randomstate"]
