"""A token store on object storage: its .idx kept once per node, its .bin read in cached blocks.

**The .idx** (every array a build or a reader indexes by) is downloaded once per node into
``S3Settings.cache_dir`` and memory-mapped like a local file. The cached file's name holds a hash
of the URL, of the object's ETag and its size, and a file appears under that name only by an atomic
rename after the download was checked: every GET carried ``If-Match`` with that ETag, the bytes add
up to the size, and a single-part upload's ETag (its MD5) matches the MD5 of what was written. So a
name that exists holds exactly that version; a changed object has a new ETag, hence a new name. A
file lock makes the ranks of a node download it once; the others wait and map the same file.

**The .bin** is never downloaded whole: :class:`RemoteTokens` looks like a read-only 1-D token array
(slices and integer-array indexing) and reads aligned blocks of ``block_bytes`` with ranged GETs,
several at once (consecutive blocks in one GET), through :class:`BlockCache`, an LRU bounded in
bytes. Blocks are keyed by URL and
ETag, so a cache never answers for another version. A loss-mask sidecar (``PREFIX.mask``) is read
the same way (:class:`RemoteBytes`).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tokenloom.errors import FormatError, StorageError
from tokenloom.io import s3

_DOWNLOAD_CHUNK = 64 << 20  # bytes per ranged GET when fetching a whole .idx


def _cache_name(info: s3.ObjectInfo) -> str:
    url_hash = hashlib.sha256(info.url.encode()).hexdigest()[:24]
    version = hashlib.sha256(f"{info.etag}:{info.size}".encode()).hexdigest()[:16]
    base = info.url.rsplit("/", 1)[-1][-64:]
    return f"{url_hash}-{version}-{base}"


def _single_part_md5(etag: str) -> str | None:
    """The MD5 an ETag states, when it is one (single-part upload without KMS), else None."""
    value = etag.strip('"').lower()
    return value if len(value) == 32 and all(c in "0123456789abcdef" for c in value) else None


def fetch_to_node_cache(info: s3.ObjectInfo) -> str:
    """Local path of a checked copy of the object ``info`` describes, downloading it if no process on
    this node has (see the module docstring)."""
    conf = s3.settings()
    try:
        os.makedirs(conf.cache_dir, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create the object-store cache directory {conf.cache_dir} ({exc}); set "
                           "TOKENLOOM_S3_CACHE_DIR to a writable node-local directory") from None
    path = os.path.join(conf.cache_dir, _cache_name(info))
    if _complete(path, info):
        return path
    with open(path + ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _complete(path, info):
            return path
        _download(info, path)
    return path


def _complete(path: str, info: s3.ObjectInfo) -> bool:
    try:
        return os.path.getsize(path) == info.size
    except OSError:
        return False


def _download(info: s3.ObjectInfo, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    md5 = hashlib.md5(usedforsecurity=False) if _single_part_md5(info.etag) else None
    try:
        with open(tmp, "wb") as f:
            for start in range(0, info.size, _DOWNLOAD_CHUNK):
                data = s3.get_range(info, start, min(info.size, start + _DOWNLOAD_CHUNK))
                f.write(data)
                if md5 is not None:
                    md5.update(data)
            f.flush()
            os.fsync(f.fileno())
        if os.path.getsize(tmp) != info.size:
            raise FormatError(f"{info.url}: downloaded {os.path.getsize(tmp)} bytes but the object holds "
                              f"{info.size}; the copy was dropped")
        if md5 is not None and md5.hexdigest() != _single_part_md5(info.etag):
            raise FormatError(f"{info.url}: the downloaded bytes have MD5 {md5.hexdigest()} but the object's ETag "
                              f"says {info.etag}; the copy was dropped (corrupted in transit?)")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _drop_older_versions(path)


def _drop_older_versions(path: str) -> None:
    """Remove finished copies of earlier versions of the same URL (open maps of them stay valid)."""
    folder, name = os.path.split(path)
    url_hash = name.split("-", 1)[0]
    try:
        for other in os.listdir(folder):
            if (other.startswith(url_hash + "-") and other != name and ".tmp-" not in other
                    and not other.endswith(".lock")):
                os.unlink(os.path.join(folder, other))
    except OSError:
        pass


class BlockCache:
    """Blocks of objects in memory, least recently used dropped first, at most ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[tuple, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple) -> bytes | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.hits += 1
            return block

    def put(self, key: tuple, block: bytes) -> None:
        with self._lock:
            if key in self._blocks or len(block) > self.capacity_bytes:
                return
            self._blocks[key] = block
            self._bytes += len(block)
            while self._bytes > self.capacity_bytes:
                _, dropped = self._blocks.popitem(last=False)
                self._bytes -= len(dropped)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        """Drop every block (to give the memory back, or to time cold reads)."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0


_shared_lock = threading.Lock()
_shared: dict = {}


def _shared_state(conf: s3.S3Settings):
    """This process's block cache and GET pool (made again after a fork or a change of settings)."""
    with _shared_lock:
        key = (os.getpid(), conf.cache_bytes, conf.concurrency)
        state = _shared.get("state")
        if state is None or state[0] != key:
            state = (key, BlockCache(conf.cache_bytes), ThreadPoolExecutor(conf.concurrency, "tokenloom-s3"))
            _shared["state"] = state
        return state[1], state[2]


def block_cache() -> BlockCache:
    """This process's block cache (its hits, misses and size; ``clear()`` empties it)."""
    return _shared_state(s3.settings())[0]


class RemoteTokens:
    """A read-only 1-D array of tokens in an object, read in blocks on demand (module docstring).

    Supports ``len``, ``shape``, ``size``, ``dtype``, slices with step 1 and indexing with an
    integer array; each returns a new ndarray.
    """

    ndim = 1

    def __init__(self, info: s3.ObjectInfo, dtype: np.dtype) -> None:
        self.info = info
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.size = info.size // self.itemsize
        self.shape = (self.size,)
        conf = s3.settings()
        self.block_bytes = max(self.itemsize, conf.block_bytes // self.itemsize * self.itemsize)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step != 1:
                return self[np.arange(start, stop, step, dtype=np.int64)]
            stop = max(start, stop)
            return self._read_runs(np.array([start], dtype=np.int64), np.array([stop - start], dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self.size if key < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(f"{self.info.url}: token {key} outside [0, {self.size})")
            return self._read_runs(np.array([i], dtype=np.int64), np.array([1], dtype=np.int64))[0]
        positions = np.asarray(key, dtype=np.int64).reshape(-1)
        if positions.size and (positions.min() < 0 or positions.max() >= self.size):
            raise IndexError(f"{self.info.url}: token positions outside [0, {self.size})")
        return self._gather(positions)

    # -- reads --------------------------------------------------------------------------------
    def _blocks(self, block_ids: np.ndarray) -> list[bytes]:
        """The blocks ``block_ids`` (ascending, unique); those not cached are fetched concurrently,
        each run of consecutive ones in one GET of at most ``MAX_GET_BYTES``."""
        cache, pool = _shared_state(s3.settings())
        ids = [int(b) for b in block_ids]
        found: list[bytes | None] = [cache.get((self.info.url, self.info.etag, b)) for b in ids]
        runs: list[list[int]] = []  # [index in ids of the first block, blocks]
        per_get = max(1, s3.MAX_GET_BYTES // self.block_bytes)
        for k, block in enumerate(found):
            if block is not None:
                continue
            if runs and runs[-1][0] + runs[-1][1] == k and ids[k - 1] + 1 == ids[k] and runs[-1][1] < per_get:
                runs[-1][1] += 1
            else:
                runs.append([k, 1])
        if not runs:
            return found  # type: ignore[return-value]

        def fetch(run: list[int]) -> bytes:
            start = ids[run[0]] * self.block_bytes
            return s3.get_range(self.info, start, min(self.info.size, start + run[1] * self.block_bytes))

        fetched = [fetch(runs[0])] if len(runs) == 1 else list(pool.map(fetch, runs))
        for (first, count), data in zip(runs, fetched):
            for j in range(count):
                block = data[j * self.block_bytes: (j + 1) * self.block_bytes]
                found[first + j] = block
                cache.put((self.info.url, self.info.etag, ids[first + j]), block)
        return found  # type: ignore[return-value]

    def _buffer(self, block_ids: np.ndarray) -> np.ndarray:
        """The blocks ``block_ids`` laid end to end, as tokens (a short final block only ever comes last)."""
        blocks = self._blocks(block_ids)
        joined = blocks[0] if len(blocks) == 1 else b"".join(blocks)
        usable = len(joined) - len(joined) % self.itemsize
        return np.frombuffer(joined, dtype=self.dtype, count=usable // self.itemsize)

    def _read_runs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens of the runs ``[starts[k], starts[k] + lengths[k])`` concatenated.

        A run's blocks are consecutive, so in the buffer of all needed blocks it is one slice.
        """
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        if starts.size == 0:
            return np.zeros(0, dtype=self.dtype)
        per_block = self.block_bytes // self.itemsize
        first = starts // per_block  # (R,) first block of each run
        last = (starts + lengths - 1) // per_block  # (R,)
        counts = last - first + 1
        spanned = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
        block_ids = np.unique(spanned)
        buffer = self._buffer(block_ids)
        begins = np.searchsorted(block_ids, first) * per_block + starts % per_block  # (R,) in buffer
        if begins.size == 1:
            return buffer[int(begins[0]): int(begins[0] + lengths[0])]
        return np.concatenate([buffer[b: b + n] for b, n in zip(begins.tolist(), lengths.tolist())])

    def _gather(self, positions: np.ndarray) -> np.ndarray:
        if positions.size == 0:
            return np.zeros(0, dtype=self.dtype)
        per_block = self.block_bytes // self.itemsize
        block_of = positions // per_block  # (P,)
        block_ids = np.unique(block_of)
        buffer = self._buffer(block_ids)
        slot = np.searchsorted(block_ids, block_of)  # (P,) where each position's block lies in buffer
        return buffer[slot * per_block + positions % per_block]

    def read_runs(self, starts, lengths) -> np.ndarray:
        """Tokens of many runs ``[starts[k], starts[k] + lengths[k])``, concatenated in one call."""
        return self._read_runs(np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64))

    def iter_bytes(self, chunk_bytes: int = _DOWNLOAD_CHUNK):
        """The whole object in order, ``chunk_bytes`` at a time (not through the block cache)."""
        for start in range(0, self.info.size, chunk_bytes):
            yield s3.get_range(self.info, start, min(self.info.size, start + chunk_bytes))


class RemoteBytes:
    """The bytes of an object from ``offset`` on, read as :class:`RemoteTokens` reads a .bin (cached
    blocks, slices and integer-array indexing): a loss-mask sidecar's bits after its header
    (:mod:`tokenloom.io.loss_mask`), which travel beside the .bin and are read the same way."""

    ndim = 1

    def __init__(self, info: s3.ObjectInfo, offset: int) -> None:
        self._bytes = RemoteTokens(info, np.dtype(np.uint8))
        self.offset = int(offset)
        self.size = max(0, info.size - self.offset)
        self.shape = (self.size,)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            return self._bytes[start + self.offset: max(start, stop) + self.offset: step]
        positions = np.asarray(key, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.size):
            raise IndexError(f"{self._bytes.info.url}: bytes outside [0, {self.size}) after the header")
        return self._bytes[positions.reshape(-1) + self.offset].reshape(positions.shape)


class _ObjectReader(io.RawIOBase):
    """A seekable read-only raw stream over one object; every read is one ranged GET."""

    def __init__(self, info: s3.ObjectInfo) -> None:
        super().__init__()
        self.info = info
        self.name = info.url
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.info.size}[whence]
        if base + offset < 0:
            raise OSError(f"{self.info.url}: seek to {base + offset}, before the start")
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        stop = min(self.info.size, self._position + len(buffer))
        if stop <= self._position:
            return 0
        data = s3.get_range(self.info, self._position, stop)
        buffer[: len(data)] = data
        self._position = stop
        return len(data)


def open_object(url: str, *, buffer_bytes: int = 8 << 20) -> io.BufferedReader:
    """A seekable binary file over the object at ``url``, read in GETs of ``buffer_bytes``
    (FormatError if it does not exist). Every GET is pinned to the version seen on opening."""
    return io.BufferedReader(_ObjectReader(s3.head(url)), buffer_size=buffer_bytes)


__all__ = ["BlockCache", "RemoteTokens", "block_cache", "fetch_to_node_cache", "open_object"]
