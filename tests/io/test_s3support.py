"""The S3 test helpers themselves, checked with plain boto3: moto's server answers, the fault proxy
relays byte for byte over kept-alive connections, each fault reaches the client as the error it
stands for, and the IAM setup denies one bucket and allows the other."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from botocore.config import Config
from botocore.exceptions import ClientError, ReadTimeoutError, ResponseStreamingError

from s3support import FaultProxy, denied_setup, disable_auth, make_bucket, moto_server, upload

BUCKET = "s3support"
KEY = "dir/object.bin"
DATA = bytes(range(256)) * 40  # 10 KiB


def _client(url: str, *, access_key_id: str = "testing", secret_access_key: str = "testing", **retries):
    import boto3

    config = Config(retries=retries or {"total_max_attempts": 1, "mode": "standard"},
                    read_timeout=0.5, connect_timeout=2)
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=access_key_id,
                        aws_secret_access_key=secret_access_key, config=config)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("s3support") / "object.bin"
    path.write_bytes(DATA)
    with moto_server() as url:
        make_bucket(url, BUCKET)
        make_bucket(url, BUCKET)  # idempotent
        upload(url, str(path), f"s3://{BUCKET}/{KEY}")
        yield url


@pytest.fixture(scope="module")
def running_proxy(endpoint):
    fault_proxy = FaultProxy(endpoint)
    fault_proxy.start()
    try:
        yield fault_proxy
    finally:
        fault_proxy.stop()


@pytest.fixture()
def proxy(running_proxy):
    running_proxy.clear()
    yield running_proxy
    running_proxy.clear()


def _error(excinfo) -> tuple[int, str]:
    response = excinfo.value.response
    return response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"]


def test_objects_round_trip_through_the_proxy_on_one_connection(proxy):
    s3 = _client(proxy.url)
    requests, gets, connections, logged = proxy.requests, proxy.object_gets, proxy.connections, len(proxy.log)

    assert s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    ranged = s3.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=10-99")
    assert ranged["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert ranged["ContentRange"] == f"bytes 10-99/{len(DATA)}"
    assert ranged["Body"].read() == DATA[10:100]
    assert s3.head_object(Bucket=BUCKET, Key=KEY)["ContentLength"] == len(DATA)
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]] == [KEY]
    big = DATA * 200  # 2 MB: botocore sends Expect: 100-continue
    s3.put_object(Bucket=BUCKET, Key="put-through-proxy", Body=big)
    assert _client(proxy.upstream).get_object(Bucket=BUCKET, Key="put-through-proxy")["Body"].read() == big
    with pytest.raises(ClientError) as missing:
        s3.get_object(Bucket=BUCKET, Key="no/such/key")
    assert _error(missing) == (404, "NoSuchKey")

    assert proxy.requests - requests == 6
    assert proxy.object_gets - gets == 3  # HEAD, list and PUT are not object GETs
    assert proxy.connections - connections == 1  # kept alive
    assert len(proxy.log) - logged == 6 and all(entry[3] == "ok" for entry in proxy.log[logged:])
    assert proxy.log[logged:logged + 2] == [("GET", f"/{BUCKET}/{KEY}", None, "ok"),
                                            ("GET", f"/{BUCKET}/{KEY}", "bytes=10-99", "ok")]


def test_fail_next_answers_s3_errors_without_upstream(proxy):
    s3 = _client(proxy.url)
    faults = proxy.faults
    proxy.fail_next(1)
    proxy.fail_next(1, status=500, code="InternalError")
    assert s3.head_object(Bucket=BUCKET, Key=KEY)["ContentLength"] == len(DATA)  # HEADs are never faulted
    assert s3.list_objects_v2(Bucket=BUCKET)["KeyCount"] >= 1  # nor bucket GETs
    with pytest.raises(ClientError) as slow_down:
        s3.get_object(Bucket=BUCKET, Key=KEY)
    assert _error(slow_down) == (503, "SlowDown")
    with pytest.raises(ClientError) as internal:
        s3.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=0-9")
    assert _error(internal) == (500, "InternalError")
    assert s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA  # the same connection goes on
    assert proxy.faults - faults == 2
    assert [e[2:] for e in proxy.log[-3:]] == [(None, "fail"), ("bytes=0-9", "fail"), (None, "ok")]


def test_slow_next_is_a_read_timeout(proxy):
    s3 = _client(proxy.url)
    proxy.slow_next(1, 2.0)
    start = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        s3.get_object(Bucket=BUCKET, Key=KEY)
    assert time.monotonic() - start < 1.5
    assert s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    assert [e[3] for e in proxy.log[-2:]] == ["slow", "ok"]


def test_cut_next_breaks_the_body_halfway(proxy):
    s3 = _client(proxy.url)
    proxy.cut_next(1)
    response = s3.get_object(Bucket=BUCKET, Key=KEY)  # status and headers arrive whole
    assert response["ContentLength"] == len(DATA)
    with pytest.raises(ResponseStreamingError, match="IncompleteRead"):
        response["Body"].read()
    assert s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    assert [e[3] for e in proxy.log[-2:]] == ["cut", "ok"]


def test_faults_come_first_in_first_out_and_clear_drops_them(proxy):
    s3 = _client(proxy.url)
    proxy.cut_next(1)
    proxy.fail_next(1)
    proxy.slow_next(1, 0.01)  # shorter than the read timeout: only late
    assert proxy.pending == 3
    with pytest.raises(ResponseStreamingError):
        s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read()
    with pytest.raises(ClientError):
        s3.get_object(Bucket=BUCKET, Key=KEY)
    assert s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    assert [e[3] for e in proxy.log[-3:]] == ["cut", "fail", "slow"]
    proxy.fail_next(5)
    proxy.clear()
    assert proxy.pending == 0
    assert s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA


def test_botocore_max_attempts_counts_retries_so_one_fault_is_retried_away(proxy):
    s3 = _client(proxy.url, max_attempts=1, mode="standard")  # 1 retry: 2 attempts in all
    proxy.fail_next(1)
    assert s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    proxy.fail_next(2)
    with pytest.raises(ClientError) as failed:
        s3.get_object(Bucket=BUCKET, Key=KEY)
    assert _error(failed) == (503, "SlowDown")


def test_a_stopped_proxy_refuses_and_a_context_managed_one_works(endpoint):
    with FaultProxy(endpoint) as fault_proxy:
        url = fault_proxy.url
        assert _client(url).get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    with pytest.raises(RuntimeError):
        fault_proxy.url  # noqa: B018
    with pytest.raises(Exception):  # noqa: B017 - connection refused, as botocore words it
        _client(url).get_object(Bucket=BUCKET, Key=KEY)


def test_denied_setup_denies_one_bucket_and_unknown_keys(endpoint, running_proxy):
    credentials = denied_setup(endpoint)
    try:
        for url in (endpoint, running_proxy.url):  # signatures survive the proxy
            user = _client(url, access_key_id=credentials["access_key_id"],
                           secret_access_key=credentials["secret_access_key"])
            allowed = user.get_object(Bucket=credentials["allowed_bucket"], Key=credentials["key"])
            assert len(allowed["Body"].read()) == credentials["size"] > 0
            with pytest.raises(ClientError) as denied:
                user.get_object(Bucket=credentials["denied_bucket"], Key=credentials["key"])
            assert _error(denied) == (403, "AccessDenied")
            with pytest.raises(ClientError) as denied_head:
                user.head_object(Bucket=credentials["denied_bucket"], Key=credentials["key"])
            assert _error(denied_head) == (403, "403")  # a HEAD has no body to name the code
            unknown = _client(url, access_key_id="AKIAUNKNOWNKEY000000")
            with pytest.raises(ClientError) as rejected:
                unknown.get_object(Bucket=credentials["allowed_bucket"], Key=credentials["key"])
            assert _error(rejected) == (403, "InvalidAccessKeyId")
        assert credentials["allowed_url"] == f"s3://{credentials['allowed_bucket']}/{credentials['key']}"
        assert credentials["denied_url"] == f"s3://{credentials['denied_bucket']}/{credentials['key']}"
    finally:
        disable_auth(endpoint)
    assert _client(endpoint).get_object(Bucket=credentials["denied_bucket"], Key=credentials["key"])["Body"].read()


def test_denied_setup_can_run_again_on_a_fresh_server():
    with moto_server() as url:  # moto's state is process-wide: the user from before exists already
        credentials = denied_setup(url)
        try:
            user = _client(url, access_key_id=credentials["access_key_id"],
                           secret_access_key=credentials["secret_access_key"])
            with pytest.raises(ClientError) as denied:
                user.get_object(Bucket=credentials["denied_bucket"], Key=credentials["key"])
            assert _error(denied) == (403, "AccessDenied")
        finally:
            disable_auth(url)
