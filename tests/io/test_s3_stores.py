"""Token stores on object storage, against a real S3 endpoint (moto's server on 127.0.0.1).

Every read from ``s3://`` must equal the same store read from local disk, byte for byte, also
through injected faults (503 bursts, responses slower than the read timeout, connections cut
mid-body); missing and denied objects and truncated .bin files are errors naming the URL.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from s3support import FaultProxy, denied_setup, disable_auth, make_bucket, moto_server, upload
from tokenloom.errors import ConfigError, FormatError, StorageError
from tokenloom.io import (
    IndexedDataset,
    IndexedDatasetWriter,
    inspect_store,
    merge_stores,
    s3,
)

BUCKET = "corpus"


@pytest.fixture(scope="module")
def endpoint():
    with moto_server() as url:
        make_bucket(url, BUCKET)
        yield url


@pytest.fixture(scope="module")
def proxy(endpoint):
    fault_proxy = FaultProxy(endpoint)
    fault_proxy.start()
    try:
        yield fault_proxy
    finally:
        fault_proxy.stop()


def _use(monkeypatch, tmp_path, url: str, **settings) -> None:
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "TOKENLOOM_S3_CACHE_DIR": str(tmp_path / "node-cache"),
           "TOKENLOOM_S3_BLOCK_KIB": "16", "TOKENLOOM_S3_BACKOFF_S": "0.01",
           "TOKENLOOM_S3_READ_TIMEOUT_S": "1", "TOKENLOOM_S3_MAX_ATTEMPTS": "12"}
    env.update(settings)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture()
def direct(monkeypatch, tmp_path, endpoint):
    _use(monkeypatch, tmp_path, endpoint)
    return endpoint


@pytest.fixture()
def faulty(monkeypatch, tmp_path, proxy):
    _use(monkeypatch, tmp_path, proxy.url)
    proxy.clear()
    yield proxy
    proxy.clear()


def _write_store(prefix: str, num_documents: int, seed: int, *, vocab: int = 60000, metadata=True) -> str:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 700, size=num_documents)
    tokens = rng.integers(0, vocab, size=int(lengths.sum())).astype(np.uint16)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        writer.add_documents(tokens, lengths)
        writer.finalize({"tokenizer": {"kind": "test", "vocab_size": vocab, "eod_id": 0}} if metadata else None)
    return prefix


def _upload_store(endpoint: str, prefix: str, url: str, *, suffixes=(".idx", ".bin", ".meta.json")) -> str:
    for suffix in suffixes:
        if os.path.exists(prefix + suffix):
            upload(endpoint, prefix + suffix, url + suffix)
    return url


_counter = iter(range(10**6))


@pytest.fixture()
def stores(tmp_path, endpoint):
    """Three local stores and their uploaded copies (fresh keys per test)."""
    n = next(_counter)
    local, remote = [], []
    for k in range(3):
        prefix = _write_store(str(tmp_path / f"store{k}"), 300 + 150 * k, seed=k)
        local.append(prefix)
        remote.append(_upload_store(endpoint, prefix, f"s3://{BUCKET}/t{n}/store{k}"))
    return local, remote


def _random_spans(store: IndexedDataset, rng, count: int):
    ids = rng.integers(0, store.num_sequences, size=count)
    lengths = store.sequence_lengths[ids].astype(np.int64)
    offsets = (rng.random(count) * lengths).astype(np.int64)
    takes = ((lengths - offsets) * rng.random(count)).astype(np.int64)
    return ids, offsets, takes


def _assert_same_reads(local: IndexedDataset, remote: IndexedDataset, seed: int = 0) -> None:
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        np.testing.assert_array_equal(getattr(remote, name), getattr(local, name), err_msg=name)
    assert remote.bin_size == local.bin_size and remote.dtype == local.dtype
    rng = np.random.default_rng(seed)
    for i in rng.integers(0, local.num_sequences, size=20):
        np.testing.assert_array_equal(remote.get(int(i)), local.get(int(i)))
    ids, offsets, takes = _random_spans(local, rng, 200)
    np.testing.assert_array_equal(remote.read_spans(ids, offsets, takes), local.read_spans(ids, offsets, takes))
    np.testing.assert_array_equal(remote.tokens[:], local.tokens[:])
    positions = rng.integers(0, local.tokens.shape[0], size=1000)
    np.testing.assert_array_equal(remote.tokens[positions], local.tokens[positions])
    np.testing.assert_array_equal(remote.window(3, 5, 4000), local.window(3, 5, 4000))
    assert remote.metadata == local.metadata


def test_a_store_on_s3_reads_like_the_local_one(direct, stores):
    local, remote = stores
    for lp, rp in zip(local, remote):
        _assert_same_reads(IndexedDataset(lp), IndexedDataset(rp))
    report_local, report_remote = inspect_store(local[0], scan_tokens=True), inspect_store(remote[0], scan_tokens=True)
    assert report_remote.prefix == remote[0]
    assert {**report_remote.to_dict(), "prefix": None} == {**report_local.to_dict(), "prefix": None}


def test_the_idx_is_fetched_once_per_node_and_blocks_come_from_the_cache(faulty, stores, tmp_path):
    _, remote = stores
    idx_gets = lambda: sum(1 for entry in faulty.log if entry[1].endswith(".idx") and entry[0] == "GET")  # noqa: E731
    barrier = threading.Barrier(4)
    opened = []

    def open_one():
        barrier.wait()
        opened.append(IndexedDataset(remote[1]))

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 4 and idx_gets() == 1  # four openers at once (separate locks), one download
    cached = [name for name in os.listdir(tmp_path / "node-cache") if not name.endswith(".lock")]
    assert len(cached) == 1 and ".tmp-" not in cached[0]
    store = opened[0]
    before = faulty.object_gets
    first = store.get(5)
    assert faulty.object_gets > before
    after_first = faulty.object_gets
    np.testing.assert_array_equal(store.get(5), first)
    assert faulty.object_gets == after_first  # served from the block cache
    IndexedDataset(remote[1])
    assert idx_gets() == 1  # the node's copy is reused while the ETag is unchanged


def test_faults_are_retried_and_reads_stay_identical(faulty, stores):
    local, remote = stores
    expected = IndexedDataset(local[2])
    retries, faults = s3.STATS.retries, faulty.faults
    faulty.fail_next(3, status=503, code="SlowDown")
    faulty.cut_next(2)
    faulty.slow_next(1, 2.5)  # longer than the 1 s read timeout
    faulty.fail_next(2, status=500, code="InternalError")
    store = IndexedDataset(remote[2])
    _assert_same_reads(expected, store, seed=3)
    assert faulty.faults - faults == 8
    assert s3.STATS.retries - retries == 8


def test_a_store_that_keeps_failing_is_an_error_naming_the_url(faulty, stores, monkeypatch):
    _, remote = stores
    monkeypatch.setenv("TOKENLOOM_S3_MAX_ATTEMPTS", "3")
    faulty.fail_next(50, status=503, code="SlowDown")
    with pytest.raises(StorageError, match=rf"{remote[0]}\.idx: cannot .* after 3 attempts.*SlowDown"):
        IndexedDataset(remote[0])


def test_missing_objects_and_bad_urls_are_clean_errors(direct, stores, endpoint, tmp_path):
    local, _ = stores
    with pytest.raises(FormatError, match=rf"s3://{BUCKET}/nothing/here\.idx: no such object"):
        IndexedDataset(f"s3://{BUCKET}/nothing/here")
    with pytest.raises(FormatError, match=r"s3://no-such-bucket/x\.idx: no such object"):
        IndexedDataset("s3://no-such-bucket/x")
    half = _upload_store(endpoint, local[0], f"s3://{BUCKET}/only-idx/s", suffixes=(".idx",))
    with pytest.raises(FormatError, match=rf"{half}\.bin: no such object"):
        IndexedDataset(half)
    with pytest.raises(ConfigError, match="needs a bucket and a key"):
        IndexedDataset("s3://just-a-bucket")


def test_a_truncated_bin_is_refused_and_nothing_wrong_is_served(direct, stores, endpoint, tmp_path):
    local, _ = stores
    cut = tmp_path / "cut.bin"
    data = open(local[0] + ".bin", "rb").read()
    cut.write_bytes(data[: len(data) // 2])
    upload(endpoint, local[0] + ".idx", f"s3://{BUCKET}/cut/s.idx")
    upload(endpoint, str(cut), f"s3://{BUCKET}/cut/s.bin")
    with pytest.raises(FormatError, match=rf"s3://{BUCKET}/cut/s\.bin: file is {len(data) // 2} bytes .* truncated"):
        IndexedDataset(f"s3://{BUCKET}/cut/s")
    bad_idx = tmp_path / "bad.idx"
    bad_idx.write_bytes(open(local[0] + ".idx", "rb").read()[:-8])
    upload(endpoint, str(bad_idx), f"s3://{BUCKET}/cut/t.idx")
    upload(endpoint, local[0] + ".bin", f"s3://{BUCKET}/cut/t.bin")
    with pytest.raises(FormatError, match=rf"s3://{BUCKET}/cut/t\.idx: file is .* truncated"):
        IndexedDataset(f"s3://{BUCKET}/cut/t")


def test_an_object_replaced_under_a_reader_is_an_error_not_a_mix(direct, endpoint, tmp_path):
    first = _write_store(str(tmp_path / "v1"), 400, seed=1)
    second = _write_store(str(tmp_path / "v2"), 400, seed=2)
    url = _upload_store(endpoint, first, f"s3://{BUCKET}/replaced/s")
    store = IndexedDataset(url)
    np.testing.assert_array_equal(store.get(0), IndexedDataset(first).get(0))
    upload(endpoint, second + ".bin", url + ".bin")
    with pytest.raises(StorageError, match=rf"{url}\.bin: the object changed while it was being read"):
        store.tokens[store.tokens.shape[0] - 10:]  # a block not read before
    _upload_store(endpoint, second, url)
    np.testing.assert_array_equal(IndexedDataset(url).get(0), IndexedDataset(second).get(0))  # a new version


def test_denied_buckets_are_errors_naming_the_url(monkeypatch, tmp_path):
    with moto_server() as url:
        credentials = denied_setup(url)
        try:
            _use(monkeypatch, tmp_path, url, AWS_ACCESS_KEY_ID=credentials["access_key_id"],
                 AWS_SECRET_ACCESS_KEY=credentials["secret_access_key"])
            with pytest.raises(StorageError, match=rf"{credentials['denied_url']}: access denied"):
                s3.head(credentials["denied_url"])
            assert s3.head(credentials["allowed_url"]).size > 0
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
            with pytest.raises(StorageError, match=r"access denied.*AWS_ACCESS_KEY_ID"):
                IndexedDataset(credentials["allowed_url"].rsplit(".", 1)[0])
        finally:
            disable_auth(url)


def test_merge_reads_s3_inputs_and_refuses_an_s3_output(direct, stores, tmp_path):
    local, remote = stores
    merge_stores(local, str(tmp_path / "merged_local"))
    merge_stores(remote, str(tmp_path / "merged_remote"))
    for suffix in (".bin", ".idx"):
        assert open(str(tmp_path / "merged_remote") + suffix, "rb").read() == \
            open(str(tmp_path / "merged_local") + suffix, "rb").read()
    with pytest.raises(ConfigError, match=r"written to local .* filesystems only"):
        merge_stores(local, f"s3://{BUCKET}/out/merged")


def test_settings_from_the_environment_are_checked(direct, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_S3_BLOCK_KIB", "lots")
    with pytest.raises(ConfigError, match="TOKENLOOM_S3_BLOCK_KIB='lots' is not a number"):
        s3.settings()
    monkeypatch.setenv("TOKENLOOM_S3_BLOCK_KIB", "0.5")
    with pytest.raises(ConfigError, match=r"TOKENLOOM_S3_BLOCK_KIB='0\.5' must be at least 1"):
        s3.settings()
    monkeypatch.setenv("TOKENLOOM_S3_BLOCK_KIB", "64")
    monkeypatch.setenv("TOKENLOOM_S3_MAX_ATTEMPTS", "0")
    with pytest.raises(ConfigError, match="TOKENLOOM_S3_MAX_ATTEMPTS='0' must be at least 1"):
        s3.settings()


def test_the_cli_inspects_an_s3_store(direct, stores, capsys):
    from tokenloom.cli import main

    _, remote = stores
    assert main(["inspect", remote[0], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    report = report[0] if isinstance(report, list) else report
    assert report["prefix"] == remote[0] and report["consistent"]


def test_writing_a_store_to_s3_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from tokenloom.builder.tokenize import tokenize_on_ranks
    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n', encoding="utf-8")
    for tokenize in (tokenize_on_ranks, tokenize_to_store):
        with pytest.raises(ConfigError, match=r"s3://bucket/out: stores are written to local"):
            tokenize(["in.jsonl"], "s3://bucket/out", TokenizeConfig(workers=0))
    assert os.listdir(tmp_path) == ["in.jsonl"]  # no "s3:" folder, no parts


def test_consecutive_missing_blocks_are_fetched_in_one_get(faulty, stores, monkeypatch):
    from tokenloom.io import remote

    local, remote_prefixes = stores
    monkeypatch.setattr(s3, "MAX_GET_BYTES", 64 << 10)  # 4 blocks of 16 KiB per GET
    store, expected = IndexedDataset(remote_prefixes[2]), IndexedDataset(local[2])
    remote.block_cache().clear()
    blocks = -(-store.bin_size // (16 << 10))
    np.testing.assert_array_equal(store.tokens[8192:8200], expected.tokens[8192:8200])  # block 1 only
    before = faulty.object_gets
    np.testing.assert_array_equal(store.tokens[:], expected.tokens[:])
    # block 0 alone, then blocks 2.. in runs of at most 4
    assert faulty.object_gets - before == 1 + -(-(blocks - 2) // 4)
    ranges = [entry[2] for entry in faulty.log[-(faulty.object_gets - before):]]
    assert f"bytes=0-{(16 << 10) - 1}" in ranges and f"bytes={32 << 10}-{(96 << 10) - 1}" in ranges


def test_a_loss_mask_travels_and_reads_like_the_local_one(direct, endpoint, tmp_path):
    """The .mask object beside the others: read in blocks (a mask of several 16 KiB blocks),
    validated, merged and fingerprinted as the local store is; missing, it is named."""
    from tokenloom.builder.stores import fingerprint_store
    from tokenloom.io import validate

    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 900, size=700)
    tokens = rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16)
    mask = (rng.random(tokens.size) < 0.6).astype(np.uint8)
    prefix = str(tmp_path / "chat")
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        writer.add_documents(tokens, lengths, loss_mask=mask)
        writer.finalize({"tokenizer": {"kind": "test", "vocab_size": 60000, "eod_id": 0}})
    assert os.path.getsize(prefix + ".mask") > 2 * 16 * 1024
    url = _upload_store(endpoint, prefix, f"s3://{BUCKET}/masked/chat",
                        suffixes=(".idx", ".bin", ".meta.json", ".mask"))
    local, remote = IndexedDataset(prefix), IndexedDataset(url)
    assert remote.has_loss_mask
    validate(remote)
    ids, offsets, takes = _random_spans(local, rng, 200)
    np.testing.assert_array_equal(remote.read_loss_mask_spans(ids, offsets, takes),
                                  local.read_loss_mask_spans(ids, offsets, takes))
    for i in rng.integers(0, local.num_sequences, size=20):
        np.testing.assert_array_equal(remote.get_loss_mask(int(i)), local.get_loss_mask(int(i)))
    merge_stores([url, url], str(tmp_path / "merged_remote"))
    merge_stores([prefix, prefix], str(tmp_path / "merged_local"))
    assert open(tmp_path / "merged_remote.mask", "rb").read() == open(tmp_path / "merged_local.mask", "rb").read()
    fingerprint = fingerprint_store(url, lambda n: [(0, n)]).fingerprint
    assert fingerprint.mask_sha256 == local.metadata["loss_mask"]["sha256"]
    assert fingerprint.mask_bytes == os.path.getsize(prefix + ".mask")
    no_mask = _upload_store(endpoint, prefix, f"s3://{BUCKET}/masked/nomask")
    with pytest.raises(FormatError, match=rf"{no_mask}\.mask: no such object"):
        IndexedDataset(no_mask).get_loss_mask(0)
