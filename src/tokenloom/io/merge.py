"""Merge several token stores into one, byte for byte (no re-tokenization)."""

from __future__ import annotations

import os

from tokenloom.errors import ConfigError
from tokenloom.io.format import normalize_prefix
from tokenloom.io.loss_mask import mask_file_bytes
from tokenloom.io.reader import IndexedDataset
from tokenloom.io.report import validate
from tokenloom.io.space import check_space
from tokenloom.io.writer import IndexedDatasetWriter


def _merged_metadata(datasets: list[IndexedDataset]) -> dict | None:
    records = [(ds.metadata or {}).get("tokenizer") for ds in datasets]
    known = [(ds, r) for ds, r in zip(datasets, records) if r is not None]
    if not known:
        return None
    first_ds, first = known[0]
    for ds, record in known[1:]:
        if record != first:
            raise ConfigError(
                f"cannot merge {ds.prefix} into {first_ds.prefix}: they were tokenized differently "
                f"({record} vs {first}); merged stores must share one tokenizer"
            )
    return {
        "tokenizer": first,
        "source": {"merged_from": [ds.prefix for ds in datasets]},
    }


def merge_stores(prefixes, output_prefix) -> IndexedDataset:
    """Concatenate the stores at ``prefixes`` (in order) into ``output_prefix``.

    Every input is validated first; all must share a dtype (and tokenizer record, when they
    have one). Documents keep their order; the .bin files are copied as bytes. Where an input
    has a loss mask (``PREFIX.mask``) the output has one: the inputs' masks in order, ones for
    the inputs without. The output appears atomically, like any store written by
    ``IndexedDatasetWriter``.
    """
    prefixes = [normalize_prefix(p) for p in prefixes]
    if not prefixes:
        raise ConfigError("merge_stores needs at least one input store")
    output_prefix = normalize_prefix(output_prefix)
    if output_prefix in prefixes:
        raise ConfigError(f"merge output {output_prefix} is also one of its inputs")
    datasets = [IndexedDataset(p) for p in prefixes]
    for ds in datasets:
        validate(ds)
        if ds.dtype != datasets[0].dtype:
            raise ConfigError(
                f"cannot merge {ds.prefix} (dtype {ds.dtype}) with {datasets[0].prefix} "
                f"(dtype {datasets[0].dtype}); all inputs must share one token dtype"
            )
    metadata = _merged_metadata(datasets)

    # the whole .bin is known: say so before writing rather than after the disk fills
    needed = sum(ds.bin_size + ds.header.expected_idx_size() for ds in datasets)
    if any(ds.has_loss_mask for ds in datasets):
        needed += mask_file_bytes(sum(ds.num_tokens for ds in datasets))
    check_space(os.path.dirname(os.path.abspath(output_prefix)), needed, f"the merged store {output_prefix}")
    writer = IndexedDatasetWriter(output_prefix, dtype=datasets[0].dtype)
    writer.expected_bytes = needed
    try:
        for ds in datasets:
            writer.append_store(ds)
        writer.finalize(metadata)
    except BaseException:
        writer.abort()
        raise
    return IndexedDataset(output_prefix)


__all__ = ["merge_stores"]
