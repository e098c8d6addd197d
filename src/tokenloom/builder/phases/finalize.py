"""Phase 5, finalize and open: the writers record the manifest (and the megatron-core cache) and
keep the plan for the next start; every rank opens the result by mmap.

:func:`finalize` writes what the build leaves behind (:func:`write_manifest`);
:func:`open_result` opens the :class:`BuildResult`, with the split weights and the token budgets
it serves (:func:`split_weights`, :func:`budgets`). The caller agrees once for both.
"""

from __future__ import annotations

import os
import platform

import numpy as np

from tokenloom._version import __version__
from tokenloom.builder.cache import host_record
from tokenloom.builder.collective import Failure, collector_paused, failure_from
from tokenloom.builder.config import array_config
from tokenloom.builder.context import BuildContext
from tokenloom.builder.items import BuildPlan
from tokenloom.builder.megatron_export import export_megatron_item
from tokenloom.builder.packs import CACHE_FORMAT_VERSION
from tokenloom.builder.result import BuildResult
from tokenloom.builder.starts import write_start
from tokenloom.errors import BuildError
from tokenloom.io.space import full_disk_error, is_full
from tokenloom.io.writer import compact_json
from tokenloom.source.keys import build_key as make_build_key
from tokenloom.source.keys import canonical_json


def finalize(ctx: BuildContext, plan: BuildPlan, nodes, built) -> tuple[str, Failure | None]:
    """The build key; the writers write the manifest and keep the plan for the next start, and
    ranks place megatron-core's files. Returns this rank's failure (the caller agrees)."""
    infos = ctx.infos
    arrays_config = array_config(ctx.config)
    build_key = make_build_key({
        "format": CACHE_FORMAT_VERSION, "config": arrays_config,
        "items": sorted(item.key for item in plan.items),
        "splits": [[s.name, list(s.dataset_keys), s.blend_key] for s in plan.splits],
    })
    failure = None
    writer = nodes[ctx.rank] == ctx.rank
    try:
        if writer:
            manifest_path = ctx.cache.manifest_path(build_key)
            if built or not os.path.isfile(manifest_path):  # a warm start keeps the manifest
                if infos is None:
                    raise BuildError(f"{manifest_path}: the build's manifest vanished while the build "
                                     "started from its warm-start record; run the build again")
                write_manifest(ctx, plan, infos, built, build_key, arrays_config)
            if infos is not None and ctx.start_key is not None and ctx.memo is not None:
                write_start(ctx.cache.root, ctx.start_key, build_key=build_key, prefixes=ctx.config.prefixes,
                            infos=infos, memo=ctx.memo, items=plan.items, splits=plan.splits)
        if ctx.config.megatron_cache_dir is not None:
            # on a shared filesystem every rank places a share of the items; else each node's writer all
            if ctx.config.shared_fs:
                share = plan.items[ctx.rank::ctx.world]
            else:
                share = plan.items if writer else ()
            for item in share:
                export_megatron_item(ctx.cache, item, ctx.config.megatron_cache_dir)
    except Exception as exc:
        if is_full(exc):  # the manifest or the warm-start record (the export says its own)
            exc = full_disk_error(exc, ctx.cache.root, "the build's manifest")
        failure = ctx.failed(exc, "finalize", None)
    return build_key, failure


def write_manifest(ctx: BuildContext, plan, infos, built, build_key, array_config) -> str:
    """Write the build's manifest into the cache; returns its path."""
    # this node's copy of each record (its own pack offsets), one pack index at a time, each
    # entry kept as its compact JSON text and the file written as it goes: the writer holds
    # about the manifest's bytes once, not thousands of records, their dicts and the text
    items = {item.key: item for item in plan.items}
    held = {}
    for key, record in ctx.cache.stream_records(list(items)):
        item = items[key]
        held[key] = compact_json({
            "key": key, "kind": item.kind, "split": item.split, "label": item.label,
            "pack": record["pack"], "files": record["files"], "built_this_run": key in built,
            "built_by_rank": record["built_by"]["rank"], "seconds": record["seconds"],
            "megatron_md5": record.get("megatron_md5"),
        })
    manifest = {
        "format": "tokenloom-build-manifest", "version": CACHE_FORMAT_VERSION,
        "build_key": build_key, "tokenloom_version": __version__,
        "numpy_version": np.__version__, "python_version": platform.python_version(),
        "created": host_record(), "world_size": ctx.world,
        "config": ctx.config.to_dict(), "array_config_json": canonical_json(array_config),
        "stores": {p: {"fingerprint": i.fingerprint.to_dict(), "num_sequences": i.num_sequences,
                       "num_tokens": i.num_tokens} for p, i in infos.items()},
        "splits": [{"name": s.name, "prefixes": list(s.prefixes), "dataset_keys": list(s.dataset_keys),
                    "blend_key": s.blend_key, "num_samples": s.num_samples} for s in plan.splits],
        "timings_rank0": dict(ctx.timings), "ranks": list(ctx.rank_seconds),
    }
    # in the plan's order, each entry dropped once written
    return ctx.cache.write_manifest(build_key, manifest, items=(held.pop(item.key) for item in plan.items))


def open_result(ctx: BuildContext, plan: BuildPlan, build_key: str, built: set[str],
                failure: Failure | None) -> tuple[BuildResult | None, Failure | None]:
    """The result, opened by mmap unless this rank already failed, and this rank's failure (the
    caller agrees)."""
    result = None
    if failure is None:
        try:
            with collector_paused():
                result = BuildResult(cache=ctx.cache, plan=plan, build_key=build_key, mode=ctx.config.mode,
                                     manifest_path=ctx.cache.manifest_path(build_key),
                                     seq_length=ctx.config.seq_length,
                                     add_extra_token=ctx.config.add_extra_token,
                                     weights=split_weights(plan), timings=ctx.timings,
                                     built_keys=frozenset(built), rank=ctx.rank, budgets=budgets(ctx),
                                     fim=ctx.config.fim, seed=ctx.config.seed)
        except Exception as exc:
            failure = failure_from(exc, rank=ctx.rank, phase="open", item=None)
    return result, failure


def budgets(ctx: BuildContext) -> dict[str, dict[str, int]] | None:
    """The train split's token budgets by store, where the config gave budgets."""
    blend = ctx.config.blend_for_split(0)
    if blend is None or blend.budget_tokens is None:
        return None
    return {"train": dict(zip(blend.prefixes, blend.budget_tokens))}


def split_weights(plan: BuildPlan) -> dict[str, tuple[float, ...]]:
    """Each split's blend weights, normalised (``(1.0,)`` for a split that reads one store)."""
    out = {}
    for split in plan.splits:
        if split.blend_key is None:
            out[split.name] = (1.0,)
            continue
        weights = np.asarray(plan.item(split.blend_key).params["weights"], dtype=np.float64)
        out[split.name] = tuple((weights / weights.sum()).tolist())
    return out


__all__ = ["budgets", "finalize", "open_result", "split_weights", "write_manifest"]
