"""Best-fit items (``packing: best_fit``): the packed chunks, and the index each split serves.

A best-fit split of a store (:mod:`tokenloom.index.best_fit_index`) is made of two kinds of item:

* ``pack`` -- one chunk of the split's document order packed best fit (about four million
  documents, whole windows): the ``documents``, ``begins``, ``lengths`` and ``offsets`` arrays.
  Its key hashes the store's fingerprint, the split's documents, the chunk, the sample capacity,
  the window and the seed, not the number of samples asked for: changing ``train_samples`` or a
  blend's weights packs nothing again.
* ``gpt`` -- what a split serves from those chunks: the epochs a request takes and the chunks'
  sample counts (one small array). Serving maps the chunks and shuffles each epoch on demand.

A split's sample count is only known once its chunks are packed, and the plan needs it (an
unweighted blend is as long as its datasets), so the chunks are built in their own phase between
fingerprinting and planning (:mod:`tokenloom.builder.runner`), divided over every rank.
Megatron-LM has no such kind of index: a best-fit build writes nothing for megatron-core's cache.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from tokenloom.builder.cache import Cache
from tokenloom.builder.packs import CACHE_FORMAT_VERSION
from tokenloom.builder.stores import StoreInfo
from tokenloom.errors import BuildError
from tokenloom.index.best_fit_index import (
    ARRAY_NAMES,
    BestFitIndex,
    BestFitPlan,
    chunk_bounds,
    pack_chunk,
    pack_chunk_arrays,
    resolve_window,
)
from tokenloom.io import IndexedDataset
from tokenloom.source.keys import hash_key

COST_PER_PACKED_DOCUMENT_S = 350e-9
"""Best-fit packing per document: the Feistel order, the gather of its length, the sort and
fit of its window, and writing its piece (BENCHMARKS.md, best-fit packing)."""
COST_PER_PACK_ITEM_S = 2e-3
"""Fixed cost of a chunk: opening the store, its record, its files in a pack."""


def sample_capacity(config) -> int:
    """Tokens a sample holds: ``seq_length`` plus the extra label token when the config adds it."""
    return int(config.seq_length) + int(config.add_extra_token)


def pack_params(config, info: StoreInfo, begin: int, end: int, first: int, stop: int) -> dict[str, Any]:
    """Everything that determines one chunk's arrays (its cache key hashes exactly this)."""
    capacity = sample_capacity(config)
    return {"format": CACHE_FORMAT_VERSION, "kind": "pack", "store": info.fingerprint.to_dict(),
            "begin": begin, "end": end, "first": first, "stop": stop, "capacity": capacity,
            "window": resolve_window(config.best_fit_window, capacity), "seed": config.seed}


def pack_items(config, info: StoreInfo, begin: int, end: int, make_item) -> list:
    """The ``pack`` items of documents ``[begin, end)`` of ``info``'s store, one per chunk
    (``make_item(**fields)`` makes the WorkItem)."""
    capacity = sample_capacity(config)
    window = resolve_window(config.best_fit_window, capacity)
    chunks = chunk_bounds(end - begin, window)
    out = []
    for index, (first, stop) in enumerate(chunks):
        params = pack_params(config, info, begin, end, first, stop)
        documents = stop - first
        # bytes: documents and begins (4 each), lengths (4) per piece, offsets (8) per sample
        output_bytes = 16 * documents + 4096
        out.append(make_item(
            kind="pack", key=hash_key(params), split="", params=params,
            label=f"pack {info.prefix} documents {begin}..{end} chunk {index + 1}/{len(chunks)}",
            num_samples=0, output_bytes=output_bytes,
            cost_s=COST_PER_PACK_ITEM_S + COST_PER_PACKED_DOCUMENT_S * documents, prefix=info.prefix))
    return out


def build_pack_arrays(prefix: str, params: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays of one ``pack`` item and its record's fields (samples, tokens, padding, cut documents)."""
    store = IndexedDataset(prefix)
    started = time.perf_counter()
    packing = pack_chunk(store.sequence_lengths, params["begin"], params["end"], params["first"], params["stop"],
                         capacity=params["capacity"], window=params["window"], seed=params["seed"])
    arrays = pack_chunk_arrays(packing, store.num_sequences)
    record = {"num_samples": packing.num_samples, "num_tokens": packing.num_tokens,
              "num_documents": params["stop"] - params["first"], "cut_documents": packing.cut_documents,
              "pack_seconds": round(time.perf_counter() - started, 6)}
    return arrays, record


def gpt_params(config, info: StoreInfo, split: str, begin: int, end: int, num_samples: int | None,
               packs: list) -> dict[str, Any]:
    capacity = sample_capacity(config)
    return {"format": CACHE_FORMAT_VERSION, "kind": "gpt", "packing": "best_fit", "split": split,
            "store": info.fingerprint.to_dict(), "begin": begin, "end": end, "num_samples": num_samples,
            "seq_length": config.seq_length, "add_extra_token": config.add_extra_token, "seed": config.seed,
            "window": resolve_window(config.best_fit_window, capacity), "packs": [item.key for item in packs]}


def plan_of(params: Mapping[str, Any], pack_samples: list[int]) -> BestFitPlan:
    """The epochs a ``gpt`` item's request takes, given its chunks' sample counts."""
    return BestFitPlan.for_request(seq_length=params["seq_length"], add_extra_token=params["add_extra_token"],
                                   num_samples=params["num_samples"], samples_per_epoch=sum(pack_samples))


def pack_stats(record: Mapping[str, Any]) -> dict[str, int]:
    """What a split's ``gpt`` item needs of one chunk's record: its samples, tokens and cut documents."""
    return {name: int(record[name]) for name in ("num_samples", "num_tokens", "cut_documents")}


def build_gpt_arrays(params: Mapping[str, Any],
                     stats: Mapping[str, Mapping[str, int]]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A best-fit ``gpt`` item: its chunks' sample counts, and a record with its plan and what the
    packing reached (padding and cut documents over the split), from its chunks' ``stats``
    (:func:`pack_stats` of each, by key: the pack phase gathered them on every rank)."""
    missing = [key for key in params["packs"] if key not in stats]
    if missing:
        raise BuildError(f"the best-fit chunk {missing[0]} of documents {params['begin']}..{params['end']} was "
                         "not packed before its split's index (the pack phase gathers every chunk's counts)")
    chunks = [stats[key] for key in params["packs"]]
    counts = np.array([c["num_samples"] for c in chunks], dtype=np.int64)
    plan = plan_of(params, counts.tolist())
    tokens = sum(c["num_tokens"] for c in chunks)
    per_epoch = plan.samples_per_epoch
    record = {"plan": plan.to_dict(), "num_documents": params["end"] - params["begin"],
              "num_tokens": tokens, "cut_documents": sum(c["cut_documents"] for c in chunks),
              "padding_fraction": 1.0 - tokens / (per_epoch * plan.sample_num_tokens)}
    return {"chunk_samples": counts}, record


def open_index(cache: Cache, key: str, name: str) -> BestFitIndex:
    """The :class:`BestFitIndex` of ``gpt`` item ``key``, around memory maps of its chunks."""
    record = cache.read_record(key)
    params = record["params"]
    chunks = [{array: cache.open_array(pack, array) for array in ARRAY_NAMES} for pack in params["packs"]]
    counts = cache.open_array(key, "chunk_samples")
    for pack, chunk, count in zip(params["packs"], chunks, counts):
        if chunk["offsets"].shape[0] - 1 != int(count):
            raise BuildError(f"{name}: chunk {pack} holds {chunk['offsets'].shape[0] - 1} samples but its index "
                             f"counted {int(count)}; run tokenloom cache verify")
    return BestFitIndex(plan=BestFitPlan.from_dict(record["plan"]), seed=params["seed"], chunks=chunks,
                        begin=params["begin"], end=params["end"], window=params["window"], name=name)


__all__ = ["build_gpt_arrays", "build_pack_arrays", "gpt_params", "open_index", "pack_items", "pack_params",
           "pack_stats", "plan_of", "sample_capacity"]
