"""Objects on S3 and S3-compatible stores: URLs, settings, and requests that retry.

tokenloom talks to object storage through **boto3**, imported on first use (the ``[s3]`` extra).
boto3 is what the field already configures: it reads the standard AWS environment
(``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, profiles, instance and pod roles), it is what
megatron-core's own ``s3://`` reader uses, and it gives the two calls this module needs
(HEAD and ranged GET) without a filesystem layer in between.

Every request goes through :func:`_retrying`, one loop that owns all retries (botocore's own are
turned off, so they are not multiplied): 5xx answers, throttling (``SlowDown``, 429), timeouts
and connections cut mid-body are retried with full-jitter exponential backoff; a body shorter than
asked for is a cut too. 403 and 404 are not retried and become errors naming the URL. Every GET
carries ``If-Match`` with the ETag seen when the object was opened, so an object replaced while a
job reads it fails loudly (412) instead of mixing two versions.

Settings come from the environment (:class:`S3Settings`), so DataLoader workers and torchrun
ranks see the same ones without passing objects around.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from datetime import datetime

from tokenloom.errors import ConfigError, FormatError, StorageError

log = logging.getLogger(__name__)

SCHEME = "s3://"

MAX_GET_BYTES = 8 << 20
"""The most bytes one GET of consecutive .bin blocks asks for."""

_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                             "RequestLimitExceeded", "TooManyRequests", "InternalError", "ServiceUnavailable"})


def is_remote(path) -> bool:
    """True for an ``s3://`` URL (the only remote scheme tokenloom reads)."""
    return isinstance(path, str) and path.startswith(SCHEME)


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``; ConfigError for anything else."""
    if not is_remote(url):
        raise ConfigError(f"{url!r} is not an s3:// URL")
    bucket, _, key = url[len(SCHEME):].partition("/")
    if not bucket or not key:
        raise ConfigError(f"{url}: an object URL needs a bucket and a key (s3://BUCKET/KEY)")
    return bucket, key


def _env_number(name: str, default: float, *, minimum: float, integer: bool = False) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a{'n integer' if integer else ' number'}") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value


@dataclass(frozen=True, kw_only=True)
class S3Settings:
    """How tokenloom reads object storage; :meth:`from_env` reads the ``TOKENLOOM_S3_*`` variables."""

    block_bytes: int = 64 << 10
    """``TOKENLOOM_S3_BLOCK_KIB`` (default 64): the unit of .bin reads and of the block cache. Shuffled
    samples share no blocks, so every byte of a block beyond the sample is waste: a larger block
    saves no GETs (a sample's documents span about as many blocks either way) while the bytes
    fetched per token served grow with it (BENCHMARKS.md, "Object storage").
    Consecutive missing blocks are fetched in one GET of up to :data:`MAX_GET_BYTES`, so
    sequential reads still make large requests."""
    cache_bytes: int = 256 << 20
    """``TOKENLOOM_S3_CACHE_MIB`` (default 256): the most block bytes one process keeps in memory."""
    cache_dir: str = ""
    """``TOKENLOOM_S3_CACHE_DIR``: where .idx files are kept on this node (default: a directory
    under the system temp dir, which is node-local on clusters)."""
    max_attempts: int = 10
    """``TOKENLOOM_S3_MAX_ATTEMPTS``: tries per request before giving up."""
    backoff_s: float = 0.1
    """``TOKENLOOM_S3_BACKOFF_S``: first retry waits up to this long; the bound doubles per retry."""
    max_backoff_s: float = 20.0
    """The bound on one wait between tries."""
    connect_timeout_s: float = 10.0
    """``TOKENLOOM_S3_CONNECT_TIMEOUT_S``."""
    read_timeout_s: float = 60.0
    """``TOKENLOOM_S3_READ_TIMEOUT_S``: a response silent this long is abandoned and retried."""
    concurrency: int = 16
    """``TOKENLOOM_S3_CONCURRENCY``: GETs one process runs at once."""

    @classmethod
    def from_env(cls) -> S3Settings:
        uid = os.getuid() if hasattr(os, "getuid") else 0
        import tempfile

        return cls(
            block_bytes=int(_env_number("TOKENLOOM_S3_BLOCK_KIB", 64, minimum=1) * 1024) // 8 * 8,
            cache_bytes=int(_env_number("TOKENLOOM_S3_CACHE_MIB", 256, minimum=0) * (1 << 20)),
            cache_dir=os.environ.get("TOKENLOOM_S3_CACHE_DIR")
            or os.path.join(tempfile.gettempdir(), f"tokenloom-s3-{uid}"),
            max_attempts=int(_env_number("TOKENLOOM_S3_MAX_ATTEMPTS", 10, minimum=1, integer=True)),
            backoff_s=_env_number("TOKENLOOM_S3_BACKOFF_S", 0.1, minimum=0),
            connect_timeout_s=_env_number("TOKENLOOM_S3_CONNECT_TIMEOUT_S", 10, minimum=0.01),
            read_timeout_s=_env_number("TOKENLOOM_S3_READ_TIMEOUT_S", 60, minimum=0.01),
            concurrency=int(_env_number("TOKENLOOM_S3_CONCURRENCY", 16, minimum=1, integer=True)),
        )


@dataclass(frozen=True, kw_only=True)
class ObjectInfo:
    """What a HEAD says about one object."""

    url: str
    size: int
    """Bytes."""
    etag: str
    """The ETag, quotes included, as S3 returns it (changes whenever the content does)."""
    last_modified_ns: int
    """Last-Modified, nanoseconds since the epoch."""


class Stats:
    """Requests, retries and bytes of this process (for tests and benchmarks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = self.retries = self.bytes = 0

    def add(self, *, requests: int = 0, retries: int = 0, nbytes: int = 0) -> None:
        with self.lock:
            self.requests += requests
            self.retries += retries
            self.bytes += nbytes


STATS = Stats()

_client_lock = threading.Lock()
_client: tuple[tuple, object, S3Settings] | None = None  # (what it was made from, client, settings)


def settings() -> S3Settings:
    return _get_client()[1]


_AWS_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                  "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE")


def _get_client():
    """This process's boto3 client and settings, made again after a fork (clients are not fork-safe)
    or when the environment they were made from changed."""
    global _client
    with _client_lock:
        current = S3Settings.from_env()
        identity = (os.getpid(), current, tuple(os.environ.get(name) for name in _AWS_VARIABLES))
        if _client is None or _client[0] != identity:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise ConfigError("s3:// paths need boto3: pip install 'tokenloom[s3]'") from None
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
            config = Config(retries={"total_max_attempts": 1, "mode": "standard"},  # _retrying owns retries
                            connect_timeout=current.connect_timeout_s, read_timeout=current.read_timeout_s,
                            max_pool_connections=max(10, 2 * current.concurrency))
            client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
            _client = (identity, client, current)
        return _client[1], _client[2]


class _ShortBodyError(Exception):
    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"the body ended after {got} of {wanted} bytes")


def _classify(exc: BaseException) -> tuple[str, int | None, str]:
    """``(kind, status, code)``: kind is "retry", "missing", "denied", "changed" or "fatal"."""
    from botocore import exceptions as be

    if isinstance(exc, be.ClientError):
        response = exc.response or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(response.get("Error", {}).get("Code", ""))
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
            return "missing", status, code
        if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            return "denied", status, code
        if status == 412 or code == "PreconditionFailed":
            return "changed", status, code
        if (status is not None and status >= 500) or status == 429 or code in _THROTTLE_CODES:
            return "retry", status, code
        return "fatal", status, code
    retryable = (_ShortBodyError, be.ConnectionError, be.HTTPClientError, be.IncompleteReadError,
                 ConnectionError, TimeoutError)  # HTTPClientError: read timeouts, cut and streaming errors
    try:
        from urllib3 import exceptions as ue

        retryable += (ue.ProtocolError, ue.ReadTimeoutError, ue.IncompleteRead)
    except ImportError:  # pragma: no cover - botocore depends on urllib3
        pass
    if isinstance(exc, retryable):
        return "retry", None, type(exc).__name__
    return "fatal", None, type(exc).__name__


def _retrying(what: str, url: str, call):
    """``call(client)`` with this module's retry policy; errors become tokenloom errors naming ``url``."""
    client, conf = _get_client()
    attempt = 0
    while True:
        attempt += 1
        try:
            STATS.add(requests=1)
            return call(client)
        except Exception as exc:
            kind, status, code = _classify(exc)
            if kind == "missing":
                raise FormatError(f"{url}: no such object (S3 {status or ''} {code}); check the bucket and key"
                                  ) from None
            if kind == "denied":
                raise StorageError(f"{url}: access denied (S3 {status or ''} {code}) while trying to {what}; "
                                   "check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, role) and the "
                                   "bucket policy") from None
            if kind == "changed":
                raise StorageError(f"{url}: the object changed while it was being read (its ETag no longer "
                                   "matches the one seen when it was opened); reopen it, and do not replace "
                                   "stores under a running job") from None
            if kind == "fatal":
                if status is None and not hasattr(exc, "response"):
                    raise
                raise StorageError(f"{url}: cannot {what}: S3 answered {status} {code}: {exc}") from None
            if attempt >= conf.max_attempts:
                raise StorageError(f"{url}: cannot {what} after {attempt} attempts; the last failure was "
                                   f"{code or type(exc).__name__}"
                                   f"{f' (HTTP {status})' if status else ''}: {exc}") from None
            bound = min(conf.max_backoff_s, conf.backoff_s * 2 ** (attempt - 1))
            wait = random.uniform(0, bound)
            log.debug("%s: %s failed (%s %s), try %d of %d in %.2f s", url, what, status, code, attempt + 1,
                      conf.max_attempts, wait)
            STATS.add(retries=1)
            time.sleep(wait)


def head(url: str) -> ObjectInfo:
    """Size, ETag and time of the object at ``url`` (FormatError if it does not exist)."""
    bucket, key = parse_url(url)
    response = _retrying("read its size (HEAD)", url, lambda c: c.head_object(Bucket=bucket, Key=key))
    modified = response.get("LastModified")
    modified_ns = int(modified.timestamp() * 1e9) if isinstance(modified, datetime) else 0
    return ObjectInfo(url=url, size=int(response["ContentLength"]), etag=str(response.get("ETag", "")),
                      last_modified_ns=modified_ns)


def get_range(info: ObjectInfo, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` of the object ``info`` describes, exactly, or an error naming its URL.

    A body shorter than asked for is retried like a cut connection; the request carries If-Match,
    so a replaced object is a StorageError, never a mix of versions.
    """
    if not 0 <= start <= stop <= info.size:
        raise FormatError(f"{info.url}: bytes [{start}, {stop}) requested but the object holds {info.size}; "
                          "is the .bin truncated or the .idx from another store?")
    if start == stop:
        return b""
    bucket, key = parse_url(info.url)
    wanted = stop - start

    def call(client):
        response = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}",
                                     IfMatch=info.etag)
        body = response["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        if len(data) != wanted:
            raise _ShortBodyError(len(data), wanted)
        return data

    data = _retrying(f"read bytes [{start}, {stop})", info.url, call)
    STATS.add(nbytes=len(data))
    return data


def list_objects(url: str) -> list[tuple[str, int]]:
    """``(url, size)`` of every object whose key starts with the key of ``url``, in key order."""
    bucket, prefix = url[len(SCHEME):].partition("/")[::2]
    if not bucket:
        raise ConfigError(f"{url}: an object URL needs a bucket (s3://BUCKET/PREFIX)")
    found: list[tuple[str, int]] = []
    token = None
    while True:
        arguments = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
        page = _retrying("list objects", url, lambda c, a=arguments: c.list_objects_v2(**a))
        found.extend((f"{SCHEME}{bucket}/{item['Key']}", int(item["Size"])) for item in page.get("Contents", ()))
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return sorted(found)


def get_small(url: str) -> bytes | None:
    """The whole of a small object (a sidecar), or None if it does not exist."""
    try:
        info = head(url)
    except FormatError:
        return None
    return get_range(info, 0, info.size)


__all__ = ["MAX_GET_BYTES", "SCHEME", "STATS", "ObjectInfo", "S3Settings", "get_range", "get_small", "head",
           "is_remote", "list_objects", "parse_url", "settings"]
