"""A keyed pseudo-random permutation of ``[0, size)`` with O(1) random access.

No array is ever materialised: ``perm(i)`` is computed from ``i`` and a few 64-bit
round keys. The construction (the design of grain's ``index_shuffle`` and of format-
preserving encryption in general) is an alternating, possibly unbalanced Feistel
network over ``bits``-bit integers, made to fit ``[0, size)`` by cycle walking:

* ``bits = max(8, (size - 1).bit_length())``, so the Feistel domain ``[0, 2**bits)``
  holds ``size`` and is less than twice as large once ``size > 128``. Tiny sizes walk
  further (at most 256 evaluations for a whole permutation) but keep round halves of
  at least 4 bits, which tiny balanced networks lack (their permutations are biased).
* Round ``r`` (``r = 0 .. rounds-1``) splits the state ``x`` into a low part of
  ``w_r`` bits and a high part of ``bits - w_r`` bits, with ``w_0 = bits // 2`` and
  ``w_{r+1} = bits - w_r``::

      lo = x & (2**w_r - 1);  hi = x >> w_r;  h = bits - w_r
      x  = (lo << h) | ((hi + fmix64(lo ^ key_r)) mod 2**h)

  (all arithmetic on uint64, wrapping). Each round is a bijection of ``[0, 2**bits)``
  whatever the widths, so the network is one too. ``fmix64`` is the MurmurHash3 64-bit finaliser (a bijective mixer).
  Modular addition, not xor, mixes the high part: xor-only networks are always even
  permutations of the domain, a bias visible in small domains. ``rounds`` is 8 for
  ``bits <= 16`` and 4 above (:func:`default_rounds`).
* Cycle walking: apply the network until the value falls inside ``[0, size)``. The
  restriction of a bijection to the walk is a bijection of ``[0, size)``; on average
  an index takes ``2**bits / size`` network passes (below 2 once ``size > 128``), and a
  whole permutation at most ``2**bits`` passes in all.

Round keys come from ``hashlib.blake2b`` over a canonical byte string naming the
seed, the purpose, the epoch and the size (see :func:`derive_round_keys`), so a
permutation is reproducible across platforms and numpy versions from FORMAT.md.

Two backends compute bit-identical results: ``"numpy"`` (vectorised uint64
arithmetic, chunked; where numba is not installed) and ``"numba"`` (compiled loops, compiled on
first use by :mod:`tokenloom.index.kernels`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
from collections.abc import Callable

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.kernels import compiled_on_call, jit, numba_available, resolve_backend

__all__ = [
    "LARGE_DOMAIN_ROUNDS",
    "MAX_SIZE",
    "SMALL_DOMAIN_ROUNDS",
    "FeistelPermutation",
    "default_rounds",
    "derive_round_keys",
    "feistel_bits",
    "fmix64",
]

#: Rounds for domains of at most 2**16 elements. The smallest permutations (2 and 3 elements)
#: are the slowest to lose their position bias: with 6 rounds a test over many seeds still
#: detected one; with 8 none is detectable, and a small domain's rounds cost little.
SMALL_DOMAIN_ROUNDS = 8
#: Rounds above 2**16 elements: Luby-Rackoff's 4 rounds, the fewest that make a Feistel network a
#: strong pseudorandom permutation (3 rounds left a detectable excess of near neighbours; 4 did
#: not); fewer than 8 because a large domain's build pays for every round of every element.
LARGE_DOMAIN_ROUNDS = 4
SMALL_DOMAIN_BITS = 16
#: Largest supported size: the Feistel state must fit in 62 bits of a uint64.
MAX_SIZE = 1 << 62
#: Domain-separation tag of the key derivation; bump it if the construction changes.
KEY_DERIVATION_TAG = b"tokenloom.feistel.v1"

#: Smallest Feistel domain, 2**8: tiny sizes walk further but mix as well as large ones.
MIN_BITS = 8
_FMIX_C1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_U33 = np.uint64(33)
_CHUNK = 1 << 16  # elements per numpy chunk: the working set stays in L2


def feistel_bits(size: int) -> int:
    """Width in bits of the Feistel domain that holds ``[0, size)``."""
    return max(MIN_BITS, (int(size) - 1).bit_length())


def default_rounds(size: int) -> int:
    """Rounds used unless asked otherwise: 8 up to ``2**16`` elements, 4 above."""
    return SMALL_DOMAIN_ROUNDS if feistel_bits(size) <= SMALL_DOMAIN_BITS else LARGE_DOMAIN_ROUNDS


def derive_round_keys(*, seed: int, purpose: str, epoch: int, size: int, rounds: int) -> tuple[int, ...]:
    """The ``rounds`` 64-bit round keys of the permutation named by its arguments.

    ``blake2b(digest_size=8 * rounds)`` over the bytes::

        b"tokenloom.feistel.v1" | u64le(seed) | u64le(epoch) | u64le(size)
            | u64le(len(purpose_utf8)) | purpose_utf8

    read as ``rounds`` little-endian uint64 words. ``seed`` may be any integer in
    ``[0, 2**64)``; a negative seed is rejected rather than silently wrapped.
    """
    if not 1 <= rounds <= 8:
        raise ConfigError(f"rounds={rounds!r} is out of range; expected 1 <= rounds <= 8 (blake2b gives 64 bytes)")
    # TODO(validate): this and FeistelPermutation's size check accept True (a bool is an int);
    # validate.check_int refuses it, but switching would turn a call that works today into an error.
    for name, value in (("seed", seed), ("epoch", epoch), ("size", size)):
        if not isinstance(value, (int, np.integer)) or not 0 <= int(value) < (1 << 64):
            raise ConfigError(f"{name}={value!r} must be an integer in [0, 2**64)")
    tag = purpose.encode("utf-8")
    message = KEY_DERIVATION_TAG + struct.pack("<QQQQ", int(seed), int(epoch), int(size), len(tag)) + tag
    digest = hashlib.blake2b(message, digest_size=8 * rounds).digest()
    return struct.unpack(f"<{rounds}Q", digest)


def fmix64(values: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser on a uint64 array (wrapping arithmetic)."""
    z = values ^ (values >> _U33)
    z *= _FMIX_C1
    z ^= z >> _U33
    z *= _FMIX_C2
    z ^= z >> _U33
    return z


def _round_widths(bits: int, rounds: int) -> list[int]:
    """Low-part width ``w_r`` of every round: ``bits // 2`` first, then alternating."""
    widths, w = [], bits // 2
    for _ in range(rounds):
        widths.append(w)
        w = bits - w
    return widths


# ---------------------------------------------------------------------------- numpy backend


def _encrypt_numpy(x: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    """One pass of the network over a uint64 array (no cycle walking)."""
    for w, key in zip(_round_widths(bits, len(keys)), keys):
        h = bits - w
        lo = x & np.uint64((1 << w) - 1)
        hi = x >> np.uint64(w)
        mask = np.uint64((1 << h) - 1)
        x = (lo << np.uint64(h)) | ((hi + fmix64(lo ^ key)) & mask)
    return x


def _decrypt_numpy(y: np.ndarray, bits: int, keys: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_encrypt_numpy`: the rounds undone in reverse order."""
    widths = _round_widths(bits, len(keys))
    for w, key in zip(reversed(widths), keys[::-1]):
        h = bits - w
        lo = y >> np.uint64(h)
        mask = np.uint64((1 << h) - 1)
        hi = (y - fmix64(lo ^ key)) & mask  # wraps modulo 2**64, then modulo 2**h
        y = (hi << np.uint64(w)) | lo
    return y


def _walk_numpy(x: np.ndarray, size: int, bits: int, keys: np.ndarray, step: Callable) -> np.ndarray:
    """Cycle walking: re-apply ``step`` to the values still outside ``[0, size)``."""
    out = np.empty_like(x)
    limit = np.uint64(size)
    for start in range(0, len(x), _CHUNK):
        y = step(x[start : start + _CHUNK], bits, keys)  # (chunk,) uint64
        outside = np.flatnonzero(y >= limit)
        while len(outside):
            z = step(y[outside], bits, keys)
            y[outside] = z
            outside = outside[z >= limit]
        out[start : start + _CHUNK] = y
    return out


# ---------------------------------------------------------------------------- numba backend
# Plain Python, compiled by numba on first use (tokenloom.index.kernels); the stateless index's
# kernels call permute_into and _permute_numba too.


@jit(inline="always", cache=True)
def _fmix64_scalar(z):
    z ^= z >> np.uint64(33)
    z *= np.uint64(0xFF51AFD7ED558CCD)
    z ^= z >> np.uint64(33)
    z *= np.uint64(0xC4CEB9FE1A85EC53)
    z ^= z >> np.uint64(33)
    return z


@jit(cache=True, nogil=True)
def _network_batch(buf, count, bits, keys, inverse):
    """One pass of the network (or its inverse) over ``buf[:count]``, in place.

    Rounds outside, elements inside: the elements are independent, so the CPU
    overlaps their multiply chains (one index at a time would wait out each chain in turn).
    """
    rounds = keys.shape[0]
    one = np.uint64(1)
    for step in range(rounds):
        r = rounds - 1 - step if inverse else step
        w = np.uint64(bits // 2) if r % 2 == 0 else np.uint64(bits - bits // 2)
        h = np.uint64(bits) - w
        key = keys[r]
        low_mask = (one << w) - one
        high_mask = (one << h) - one
        if inverse:
            for j in range(count):
                y = buf[j]
                lo = y >> h
                hi = (y - _fmix64_scalar(lo ^ key)) & high_mask
                buf[j] = (hi << w) | lo
        else:
            for j in range(count):
                x = buf[j]
                lo = x & low_mask
                buf[j] = (lo << h) | (((x >> w) + _fmix64_scalar(lo ^ key)) & high_mask)


@jit(cache=True, nogil=True)
def _settle(buf, slot, active, limit, out):
    """Write every walked value to ``out``; keep those still outside ``[0, limit)``.

    Branch-free: a value still outside is written too, and overwritten by a later pass.
    """
    kept = 0
    for j in range(active):
        value = buf[j]
        out[slot[j]] = np.int64(value)
        buf[kept] = value
        slot[kept] = slot[j]
        kept += np.int64(value >= limit)
    return kept


@jit(cache=True, nogil=True)
def permute_into(first, count, step_size, size, bits, keys, inverse, buf, slot, out):
    """``out[k] = perm(first + k * step_size)`` for ``k < count`` (cycle walking included).

    ``buf`` (uint64) and ``slot`` (int64) are scratch arrays of at least ``count``
    elements; callers reuse them across calls. Used by the index kernels.
    """
    for k in range(count):
        buf[k] = np.uint64(first + k * step_size)
        slot[k] = k
    active = count
    limit = np.uint64(size)
    while active > 0:
        _network_batch(buf, active, bits, keys, inverse)
        active = _settle(buf, slot, active, limit, out)


@jit(cache=True, nogil=True)
def _permute_numba(indices, size, bits, keys, inverse):
    batch = 1024
    out = np.empty(indices.shape[0], dtype=np.int64)
    buf = np.empty(batch, dtype=np.uint64)
    slot = np.empty(batch, dtype=np.int64)
    active = 0
    limit = np.uint64(size)
    for start in range(0, indices.shape[0], batch):
        count = min(batch, indices.shape[0] - start)
        for k in range(count):
            buf[k] = np.uint64(indices[start + k])
            slot[k] = start + k
        active = count
        while active > 0:
            _network_batch(buf, active, bits, keys, inverse)
            active = _settle(buf, slot, active, limit, out)
    return out


def _permute_numpy(indices: np.ndarray, size: int, bits: int, keys: np.ndarray, inverse: bool) -> np.ndarray:
    step = _decrypt_numpy if inverse else _encrypt_numpy
    return _walk_numpy(indices.astype(np.uint64), size, bits, keys, step).astype(np.int64)


#: Backends that compute the permutation (those that can run here); all give identical results.
BACKENDS: dict[str, Callable[..., np.ndarray]] = {"numpy": _permute_numpy}
if numba_available():
    BACKENDS["numba"] = compiled_on_call(_permute_numba)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeistelPermutation:
    """A keyed bijection of ``[0, size)``; call it on an array of indices."""

    size: int
    """Number of elements permuted; indices are ``0 .. size-1``."""
    round_keys: tuple[int, ...]
    """One 64-bit key per Feistel round (see :func:`derive_round_keys`)."""
    backend: str = "auto"
    """``"auto"``, ``"numpy"`` or ``"numba"``; the results are identical."""

    def __post_init__(self) -> None:
        if not isinstance(self.size, (int, np.integer)) or not 1 <= int(self.size) <= MAX_SIZE:
            raise ConfigError(f"size={self.size!r} is out of range; expected an integer in [1, 2**62]")
        if not 1 <= len(self.round_keys) <= 8 or any(not 0 <= int(k) < (1 << 64) for k in self.round_keys):
            raise ConfigError(f"round_keys={self.round_keys!r} must be 1 to 8 integers in [0, 2**64)")
        object.__setattr__(self, "size", int(self.size))
        object.__setattr__(self, "backend", resolve_backend(self.backend, BACKENDS, fallback="numpy"))

    @classmethod
    def from_seed(cls, size: int, *, seed: int, purpose: str, epoch: int = 0,
                  rounds: int | None = None, backend: str = "auto") -> FeistelPermutation:
        """The permutation of ``[0, size)`` keyed by ``(seed, purpose, epoch, size)``.

        ``rounds=None`` takes :func:`default_rounds` of ``size``.
        """
        if not isinstance(size, (int, np.integer)) or not 1 <= int(size) <= MAX_SIZE:
            raise ConfigError(f"size={size!r} is out of range; expected an integer in [1, 2**62]")
        rounds = default_rounds(size) if rounds is None else rounds
        keys = derive_round_keys(seed=seed, purpose=purpose, epoch=epoch, size=size, rounds=rounds)
        return cls(size=size, round_keys=keys, backend=backend)

    @property
    def bits(self) -> int:
        """Width of the Feistel domain ``[0, 2**bits)`` walked to stay inside ``[0, size)``."""
        return feistel_bits(self.size)

    @functools.cached_property
    def keys_array(self) -> np.ndarray:
        """The round keys as a ``(rounds,) uint64`` array, for compiled kernels (made once)."""
        keys = np.array(self.round_keys, dtype=np.uint64)
        keys.flags.writeable = False
        return keys

    def apply_unchecked(self, indices: np.ndarray, inverse: bool = False) -> np.ndarray:
        """``perm(indices)`` for a 1-D int64 array already known to lie in ``[0, size)``.

        For callers that validated their indices themselves (the index lookups): skips the
        checks of :meth:`__call__`, which cost more than permuting a handful of indices."""
        return BACKENDS[self.backend](indices, self.size, self.bits, self.keys_array, inverse)

    def _apply(self, indices, inverse: bool) -> np.ndarray:
        scalar = np.ndim(indices) == 0
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise ConfigError(f"indices must be integers, got dtype {idx.dtype}")
        flat = idx.reshape(-1).astype(np.int64)
        if len(flat) and (flat.min() < 0 or flat.max() >= self.size):
            raise ConfigError(f"indices must lie in [0, {self.size}); got values in [{flat.min()}, {flat.max()}]")
        out = BACKENDS[self.backend](flat, self.size, self.bits, self.keys_array, inverse)
        return out[0] if scalar else out.reshape(idx.shape)

    def __call__(self, indices) -> np.ndarray:
        """``perm(indices)`` as int64, same shape as ``indices``."""
        return self._apply(indices, inverse=False)

    def inverse(self, indices) -> np.ndarray:
        """``perm^-1(indices)``: ``perm.inverse(perm(i)) == i``."""
        return self._apply(indices, inverse=True)
