"""The kernels behind :mod:`tokenloom.index.randomstate_shuffle`: plain Python, compiled by numba
on first use (:func:`tokenloom.index.kernels.compiled`).

MT19937 as numpy implements it (generate 624 words at a time, temper each output), numpy's
``random_interval`` (masked rejection; 64-bit draws take the high word first), and a Fisher-Yates
pass that makes a block of draws before doing that block's swaps.

The shuffle's draws do not branch on the words. numpy's rejection loop (draw, mask, try again
while above the bound) mispredicts on about every other word, which costs more than making the
word. Here every tempered word of the 624-word block is tried once, in order: its masked value is
written to the current step's slot, and the step moves on only when the value is within bound (an
add of 0 or 1); the mask halves, again by a shift of 0 or 1, when the bound falls to half of it.
The words consumed, the values kept and the state left are numpy's.
"""

from __future__ import annotations

import numpy as np

from tokenloom.index.kernels import jit

MT_STATE_WORDS = 624
"""MT19937 state size in 32-bit words."""
MT_SHIFT = 397
_UPPER = np.uint32(0x80000000)
_LOWER = np.uint32(0x7FFFFFFF)
_MATRIX = np.uint32(0x9908B0DF)
_ONE = np.uint32(1)
_ZERO = np.uint32(0)


@jit(inline="always", cache=True)
def _twist(key, i, successor, source):
    y = (key[i] & _UPPER) | (key[successor] & _LOWER)
    key[i] = key[source] ^ (y >> _ONE) ^ ((_ZERO - (y & _ONE)) & _MATRIX)


@jit(inline="always", cache=True)
def _regenerate(key):
    """The next 624 words of the state, in place."""
    for i in range(MT_STATE_WORDS - MT_SHIFT):
        _twist(key, i, i + 1, i + MT_SHIFT)
    for i in range(MT_STATE_WORDS - MT_SHIFT, MT_STATE_WORDS - 1):
        _twist(key, i, i + 1, i + MT_SHIFT - MT_STATE_WORDS)
    _twist(key, MT_STATE_WORDS - 1, 0, MT_SHIFT - 1)


@jit(inline="always", cache=True)
def _next_word(key, index):
    """(tempered output, next index); ``index`` 624 means the state must be regenerated first."""
    if index == MT_STATE_WORDS:
        _regenerate(key)
        index = 0
    y = key[index]
    y ^= y >> np.uint32(11)
    y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
    y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
    y ^= y >> np.uint32(18)
    return y, index + 1


@jit(inline="always", cache=True)
def _interval(key, index, largest):
    """(uniform draw in ``[0, largest]`` by masked rejection as numpy's ``random_interval``,
    next index)."""
    if largest == np.uint64(0):
        return np.uint64(0), index  # no draw at all
    mask = largest
    mask |= mask >> np.uint64(1)
    mask |= mask >> np.uint64(2)
    mask |= mask >> np.uint64(4)
    mask |= mask >> np.uint64(8)
    mask |= mask >> np.uint64(16)
    mask |= mask >> np.uint64(32)
    if largest <= np.uint64(0xFFFFFFFF):
        word, index = _next_word(key, index)
        value = np.uint64(word) & mask
        while value > largest:
            word, index = _next_word(key, index)
            value = np.uint64(word) & mask
    else:  # 64-bit draws take the high word first
        high, index = _next_word(key, index)
        low, index = _next_word(key, index)
        value = ((np.uint64(high) << np.uint64(32)) | np.uint64(low)) & mask
        while value > largest:
            high, index = _next_word(key, index)
            low, index = _next_word(key, index)
            value = ((np.uint64(high) << np.uint64(32)) | np.uint64(low)) & mask
    return value, index


@jit(inline="always", cache=True)
def _temper_all(key, words):
    """Every word of the state, tempered (numpy's output for each index), into ``words``."""
    for j in range(MT_STATE_WORDS):
        y = key[j]
        y ^= y >> np.uint32(11)
        y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
        y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
        y ^= y >> np.uint32(18)
        words[j] = np.int64(y)


@jit(inline="always", cache=True)
def _block_draws(key, words, index, largest, count, draws):
    """The partners of the ``count`` Fisher-Yates steps from bound ``largest`` (< 2**32) down, by
    masked rejection without a branch on the words (the module's docstring); ``words`` holds the
    tempered state. Returns the generator's next index."""
    step = 0
    bound = np.int64(largest)
    mask = bound
    mask |= mask >> 1
    mask |= mask >> 2
    mask |= mask >> 4
    mask |= mask >> 8
    mask |= mask >> 16
    while step < count:
        if index == MT_STATE_WORDS:
            _regenerate(key)
            _temper_all(key, words)
            index = 0
        j = index
        while j < MT_STATE_WORDS and step < count:
            value = words[j] & mask
            accepted = np.int64(value <= bound)
            draws[step] = value
            step += accepted
            bound -= accepted
            mask >>= np.int64(bound <= (mask >> 1))
            j += 1
        index = j
    return index


@jit(nogil=True, cache=True)
def shuffle(array, key, position, block):
    """Fisher-Yates from the end, as RandomState.shuffle; draws made a block ahead of swaps.
    ``position[0]`` is the generator's word index, read at the start and written at the end."""
    draws = np.empty(block, dtype=np.int64)  # (block,) the partner index of each step
    words = np.empty(MT_STATE_WORDS, dtype=np.int64)  # the state's words, tempered
    index = position[0]
    if index < MT_STATE_WORDS:
        _temper_all(key, words)
    i = array.shape[0] - 1
    while i >= 1:
        count = min(block, i)
        if i <= 0xFFFFFFFF:
            index = _block_draws(key, words, index, i, count, draws)
        else:  # 64-bit draws (arrays over 2**32 elements): numpy's loop, word by word
            for step in range(count):
                value, index = _interval(key, index, np.uint64(i - step))
                draws[step] = np.int64(value)
            if index < MT_STATE_WORDS:
                _temper_all(key, words)  # the state may have been regenerated
        for step in range(count):
            target = i - step
            other = draws[step]
            swapped = array[other]
            array[other] = array[target]
            array[target] = swapped
        i -= count
    position[0] = index


@jit(nogil=True, cache=True)
def intervals(key, position, largest, count):
    """``count`` draws in ``[0, largest]``."""
    out = np.empty(count, dtype=np.uint64)
    index = position[0]
    for k in range(count):
        out[k], index = _interval(key, index, largest)
    position[0] = index
    return out
