"""Helpers shared by the S3 tests: moto's S3 server on 127.0.0.1, a fault-injecting HTTP proxy in front
of it, bucket and upload helpers, and a setup with an IAM user that may read one bucket and not another.

Nothing here contacts anything but 127.0.0.1. moto keeps its state (buckets, IAM users, the auth switch)
in module globals, so every moto server started in one process shares it: helpers here are idempotent,
and a test that enables auth (``denied_setup``) must call ``disable_auth`` in ``finally``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

DUMMY_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"

#: Headers that describe one hop, not the message; never forwarded as they are.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                         "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "expect"})

_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Please reduce your request rate.",
    "AccessDenied": "Access Denied",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_answers(host: str, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        connection = http.client.HTTPConnection(host, port, timeout=2)
        try:
            connection.request("GET", "/moto-api/data.json")
            connection.getresponse().read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            connection.close()


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's server on 127.0.0.1 and a free port; yields its endpoint ``http://127.0.0.1:PORT``.
    werkzeug's line per request is silenced while it runs (it would flood failure reports)."""
    from moto.server import ThreadedMotoServer

    werkzeug_log = logging.getLogger("werkzeug")
    level = werkzeug_log.level
    werkzeug_log.setLevel(logging.WARNING)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        _wait_until_answers("127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        werkzeug_log.setLevel(level)


# ------------------------------------------------------------------------------------- boto3 helpers


def client(endpoint: str, service: str = "s3", **credentials):
    """A boto3 client for ``endpoint`` with the dummy credentials (or the ones given)."""
    import boto3
    from botocore.config import Config

    return boto3.client(service, endpoint_url=endpoint, region_name=REGION,
                        config=Config(retries={"max_attempts": 2, "mode": "standard"}),
                        **(credentials or DUMMY_CREDENTIALS))


def _split_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket or not key:
        raise ValueError(f"an s3:// URL needs a bucket and a key: {url!r}")
    return bucket, key


def make_bucket(endpoint: str, name: str) -> None:
    """Create bucket ``name`` (no error if this account has it already)."""
    s3 = client(endpoint)
    try:
        s3.create_bucket(Bucket=name)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass


def upload(endpoint: str, local_path: str, url: str) -> None:
    """Upload the file ``local_path`` to ``s3://bucket/key`` (one PUT; the bucket must exist)."""
    bucket, key = _split_url(url)
    with open(local_path, "rb") as f:
        client(endpoint).put_object(Bucket=bucket, Key=key, Body=f.read())


# ------------------------------------------------------------------------------------- access denied

ALLOWED_BUCKET = "allowed-bucket"
DENIED_BUCKET = "denied-bucket"
DENIED_USER = "tokenloom-reader"
_OBJECT_KEY = "store.idx"
_OBJECT_BODY = b"tokenloom denied-setup object\n" * 4


def _reset_auth(endpoint: str, count: str) -> dict:
    parts = urlsplit(endpoint)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request("POST", "/moto-api/reset-auth", body=count.encode())
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"moto reset-auth {count!r} answered {response.status}: {body!r}")
        return json.loads(body)
    finally:
        connection.close()


def enable_auth(endpoint: str) -> None:
    """From the next request on, moto checks signatures and IAM policies (process-wide)."""
    _reset_auth(endpoint, "0")


def disable_auth(endpoint: str) -> None:
    """moto's default again: no request is authenticated (process-wide)."""
    _reset_auth(endpoint, "inf")


def denied_setup(endpoint: str) -> dict:
    """With auth still off: buckets ``allowed-bucket`` and ``denied-bucket`` with an object each and an
    IAM user whose inline policy allows ``s3:*`` on allowed-bucket and its objects only; then enable
    auth. Returns the user's ``access_key_id`` / ``secret_access_key`` and the objects' URLs
    (``allowed_url``, ``denied_url``, both ``s3://<bucket>/store.idx``). Call ``disable_auth`` after."""
    s3 = client(endpoint)
    for bucket in (ALLOWED_BUCKET, DENIED_BUCKET):
        make_bucket(endpoint, bucket)
        s3.put_object(Bucket=bucket, Key=_OBJECT_KEY, Body=_OBJECT_BODY)
    iam = client(endpoint, "iam")
    try:
        iam.create_user(UserName=DENIED_USER)
    except iam.exceptions.EntityAlreadyExistsException:  # moto's state is process-wide: a second setup
        for old in iam.list_access_keys(UserName=DENIED_USER)["AccessKeyMetadata"]:
            iam.delete_access_key(UserName=DENIED_USER, AccessKeyId=old["AccessKeyId"])
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Action": "s3:*",
        "Resource": [f"arn:aws:s3:::{ALLOWED_BUCKET}", f"arn:aws:s3:::{ALLOWED_BUCKET}/*"]}]}
    iam.put_user_policy(UserName=DENIED_USER, PolicyName="allowed-bucket-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=DENIED_USER)["AccessKey"]
    enable_auth(endpoint)
    return {"access_key_id": key["AccessKeyId"], "secret_access_key": key["SecretAccessKey"],
            "user": DENIED_USER, "allowed_bucket": ALLOWED_BUCKET, "denied_bucket": DENIED_BUCKET,
            "key": _OBJECT_KEY, "allowed_url": f"s3://{ALLOWED_BUCKET}/{_OBJECT_KEY}",
            "denied_url": f"s3://{DENIED_BUCKET}/{_OBJECT_KEY}", "size": len(_OBJECT_BODY)}


# ------------------------------------------------------------------------------------- fault proxy


def _is_object_get(method: str, path: str) -> bool:
    """A GET of ``/bucket/key...`` (path-style addressing), not of a bucket or the service."""
    if method != "GET":
        return False
    _, _, key = urlsplit(path).path.lstrip("/").partition("/")
    return bool(key)


def _error_body(code: str, resource: str) -> bytes:
    message = _MESSAGES.get(code, f"Injected fault {code}")
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{resource}</Resource><RequestId>FAULTPROXY</RequestId></Error>").encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, proxy: FaultProxy):
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format, *args):
        pass  # quiet: the proxy keeps its own log

    def setup(self):
        super().setup()
        self.server.proxy._track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.server.proxy._track(self.connection, False)
            if self._upstream is not None:
                self._upstream.close()

    def handle(self):
        try:
            super().handle()
        except (OSError, http.client.HTTPException):
            pass  # a client that went away (e.g. after its read timeout) or a stopped proxy

    # Every method goes through one path.
    def do_GET(self):
        self._relay()

    def do_HEAD(self):
        self._relay()

    def do_PUT(self):
        self._relay()

    def do_POST(self):
        self._relay()

    def do_DELETE(self):
        self._relay()

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        proxy = self.server.proxy
        for attempt in range(2):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(proxy._upstream_host, proxy._upstream_port, timeout=60)
            connection = self._upstream
            try:
                connection.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        connection.putheader(name, value)
                if body or self.command in ("PUT", "POST", "PATCH"):
                    connection.putheader("Content-Length", str(len(body)))
                connection.endheaders(body or None)
                response = connection.getresponse()
                data = response.read()
                if response.will_close:
                    connection.close()
                    self._upstream = None
                return response.status, response.reason, response.getheaders(), data
            except (OSError, http.client.HTTPException):
                connection.close()
                self._upstream = None
                if attempt:  # a stale keep-alive connection gets one retry on a fresh one
                    raise
        raise AssertionError("unreachable")

    def _send_head(self, status: int, reason: str, headers: list[tuple[str, str]], content_length: int | None):
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        if content_length is not None:
            self.send_header("Content-Length", str(content_length))
        self.end_headers()

    def _relay(self):
        proxy = self.server.proxy
        body = self._read_body()
        fault = proxy._take(self.command, self.path)
        outcome = fault[0] if fault else "ok"
        entry = (self.command, urlsplit(self.path).path, self.headers.get("Range"))

        if outcome == "fail":
            proxy._log((*entry, outcome))
            _, status, code = fault
            error = _error_body(code, urlsplit(self.path).path)
            self._send_head(status, http.client.responses.get(status, "Error"),
                            [("Content-Type", "application/xml"), ("x-amz-request-id", "FAULTPROXY")], len(error))
            self.wfile.write(error)
            return

        try:
            status, reason, headers, data = self._forward(body)
        except (OSError, http.client.HTTPException) as e:
            proxy._log((*entry, f"upstream error: {e!r}"))
            error = _error_body("InternalError", urlsplit(self.path).path)
            self._send_head(502, "Bad Gateway", [("Content-Type", "application/xml")], len(error))
            self.wfile.write(error)
            return
        proxy._log((*entry, outcome))

        if self.command == "HEAD" or status in (204, 304) or 100 <= status < 200:
            # no body; a HEAD keeps the upstream's Content-Length (the object's size)
            length = next((v for n, v in headers if n.lower() == "content-length"), None)
            self._send_head(status, reason, headers, None if length is None else int(length))
            return

        if outcome == "slow":
            proxy._stopping.wait(fault[1])
        elif proxy.latency_s and _is_object_get(self.command, urlsplit(self.path).path):
            proxy._stopping.wait(proxy.latency_s)
        self._send_head(status, reason, headers, len(data))
        if outcome == "cut":
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self.wfile.write(data)


class FaultProxy:
    """An HTTP/1.1 keep-alive proxy on 127.0.0.1 in front of ``upstream`` (an endpoint URL) that relays
    every request and injects queued faults, first in first out, into object GETs (``GET /bucket/key``):

    * ``fail_next(n, status, code)``: an S3 XML error, upstream not contacted;
    * ``slow_next(n, delay_s)``: forwarded, but nothing is answered for ``delay_s``;
    * ``cut_next(n)``: the upstream's status and headers (full Content-Length), half the body, then
      the connection is shut down.

    ``requests``, ``object_gets``, ``faults`` and ``connections`` (client connections accepted) count
    what it saw; ``log`` holds one
    ``(method, path without query, Range header or None, outcome)`` per request, outcome one of
    ``ok``, ``fail``, ``slow``, ``cut`` (plus ``upstream error: ...`` entries should moto fail).
    Use as ``with FaultProxy(endpoint) as proxy:`` or ``start()`` / ``stop()``.
    """

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy relays to an http:// endpoint, not {upstream!r}")
        self.upstream = upstream
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port or 80
        self._lock = threading.Lock()
        self._faults: deque[tuple] = deque()
        self._connections: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.requests = 0
        self.object_gets = 0
        self.faults = 0
        self.connections = 0
        self.log: list[tuple[str, str, str | None, str]] = []
        self.latency_s = 0.0
        """Every object GET without a fault waits this long before answering (an endpoint's
        first-byte latency, for benchmarks)."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        if self._server is not None:
            raise RuntimeError("the proxy is started already")
        self._stopping.clear()
        self._server = _Server(self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"FaultProxy->{self.upstream}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake delayed responses and close every open client connection."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ------------------------------------------------------------------ fault controls

    def fail_next(self, n: int, status: int = 503, code: str = "SlowDown") -> None:
        self._queue(n, ("fail", int(status), str(code)))

    def slow_next(self, n: int, delay_s: float) -> None:
        self._queue(n, ("slow", float(delay_s)))

    def cut_next(self, n: int) -> None:
        self._queue(n, ("cut",))

    def clear(self) -> None:
        """Drop the faults still queued (the counters and the log stay)."""
        with self._lock:
            self._faults.clear()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._faults)

    def _queue(self, n: int, fault: tuple) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, not {n}")
        with self._lock:
            self._faults.extend([fault] * n)

    # ------------------------------------------------------------------ used by the handler threads

    def _take(self, method: str, path: str) -> tuple | None:
        """Count one request; the next queued fault if it is an object GET."""
        object_get = _is_object_get(method, path)
        with self._lock:
            self.requests += 1
            if not object_get:
                return None
            self.object_gets += 1
            if not self._faults:
                return None
            self.faults += 1
            return self._faults.popleft()

    def _log(self, entry: tuple[str, str, str | None, str]) -> None:
        with self._lock:
            self.log.append(entry)

    def _track(self, connection: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self.connections += 1
                self._connections.add(connection)
            else:
                self._connections.discard(connection)
