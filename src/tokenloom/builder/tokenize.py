"""Tokenization divided over the ranks of a job: ``torchrun ... -m tokenloom.cli tokenize``.

The inputs are cut into one run per rank of about equal bytes, in input order
(:func:`~tokenloom.tokenization.pipeline.plan_pieces`: large uncompressed JSONL and line-per-
document text files are split at line starts, others go whole). Each rank counts the lines of its
pieces so that every rank knows where its pieces' lines are numbered from (messages name the file
and the line, as one process would), tokenizes them into a part store
``OUTPUT.parts/part-RRRRR-of-WWWWW`` and records what it read beside it. Then the parts become one
store without passing through one rank: rank 0 creates the store's hidden .bin at its final size,
every rank copies its part's tokens into it at its offset, and rank 0 writes the .idx from the
parts' lengths with the metadata one process would write, renames (the .idx last) and removes the
parts. Of chat and spans input each part has its loss mask, and rank 0 appends the parts' bits to
the store's hidden .mask as it records their documents: the mask is 1/16 of a uint16 .bin, and the
SHA-256 that ``.meta.json`` records of it is one pass over all its bits in order anyway, so copying
it at offsets would save rank 0 no read (and the parts' bits do not start at byte boundaries). The
.mask is renamed into place with the .bin and the .idx, or removed with them on a failure. The
store, its mask and ``.meta.json`` (with ``assistant_prefix_tokens`` resolved) are byte-identical
to ``tokenloom tokenize`` in one process, and so is the summary but for its time and its ranks.
``OUTPUT`` must be on a filesystem every rank sees. A failure on any
rank fails every rank with the same message (the build's gloo group); a run restarted with the
same command on the same number of ranks keeps every part whose inputs and settings are unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Sequence

from tokenloom.builder.collective import agree, failure_from, open_group
from tokenloom.errors import ConfigError
from tokenloom.io import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab, s3
from tokenloom.io.format import idx_path, normalize_prefix
from tokenloom.io.writer import write_json_atomic
from tokenloom.tokenization.inputs import RECORD_FORMATS, count_lines, discover_inputs
from tokenloom.tokenization.pipeline import (
    InputPiece,
    TokenizeConfig,
    TokenizeSummary,
    engine_report,
    plan_pieces,
    store_metadata,
    tokenize_pieces,
    tokenize_to_store,
)
from tokenloom.tokenization.tokenizers import load_tokenizer

PARTS_SUFFIX = ".parts"
PART_FORMAT = "tokenloom-tokenize-part"
PART_VERSION = 2
"""Of a part's manifest: 2 counts the loss tokens and the resolved assistant header (an older part
is tokenized again rather than kept without them)."""


def _describe(piece: InputPiece) -> list:
    """What a finished part must match to be kept: its input's identity (an object's ETag) and range."""
    if s3.is_remote(piece.source.path):
        info = s3.head(piece.source.path)
        size, version = info.size, info.etag
    else:
        stat = os.stat(piece.source.path)
        size, version = stat.st_size, stat.st_mtime_ns
    begin, end = piece.byte_range if piece.byte_range is not None else (0, size)
    return [piece.source.path, size, version, begin, end, piece.first_line]


def _settings(config: TokenizeConfig, record: dict) -> dict:
    """What decides a part's tokens besides its inputs (workers, threads, chunk size and verify
    change nothing)."""
    out = dataclasses.asdict(config)
    for name in ("workers", "threads", "chunk_bytes", "verify"):
        out.pop(name, None)
    out["tokenizer_record"] = record
    return out


def _number_lines(runs: list[list[InputPiece]], counts: list[list[int]]) -> list[list[InputPiece]]:
    """Each piece with the line its range starts at: 1 + the newlines of the file's earlier pieces."""
    seen: Counter = Counter()
    out = []
    for run, run_counts in zip(runs, counts):
        numbered = []
        for piece, newlines in zip(run, run_counts):
            path = piece.source.path
            numbered.append(dataclasses.replace(piece, first_line=1 + seen[path]))
            seen[path] += newlines
        out.append(numbered)
    return out


def tokenize_on_ranks(inputs: Sequence[str] | str, output_prefix: str, config: TokenizeConfig = TokenizeConfig(), *,
                      group=None, timeout_s: float = 3600.0) -> TokenizeSummary:
    """Tokenize ``inputs`` into the store ``output_prefix`` on every rank of the job (call it on
    every rank; a job of one process tokenizes alone). Returns the whole store's summary on every
    rank. See the module's docstring."""
    started = time.perf_counter()
    if s3.is_remote(str(output_prefix)):  # every rank has the same arguments: all refuse, none waits
        raise ConfigError(f"{output_prefix}: stores are written to local (or parallel) filesystems only; write it "
                          "to a local path and upload both files (for example with `aws s3 cp`)")
    group, owned = open_group(group, timeout_s=timeout_s)
    try:
        return _run(inputs, normalize_prefix(output_prefix), config, group, started)
    finally:
        group.close()  # ours (made over the job's ranks): ranks waiting on this one fail at once
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(inputs, output: str, config: TokenizeConfig, group, started: float) -> TokenizeSummary:
    rank, world = group.rank, group.world_size
    if world == 1:  # one process: straight into the store, no parts
        return tokenize_to_store(inputs, output, config)
    failure, mine, files, record, tokenizer, runs, share = None, [], [], None, None, [], None
    try:
        files = discover_inputs(inputs, input_format=config.input_format)
        tokenizer = load_tokenizer(config.tokenizer, eod_id=config.eod_id, require_eod=config.append_eod,
                                   engine=config.engine)
        runs = plan_pieces(files, config, world)
        mine = [count_lines(p.source.path, *p.byte_range) if p.byte_range is not None else 0 for p in runs[rank]]
        # the code points gigatoken reads differently: each rank scans a share unless it is cached
        # (pre-tokenized spans encode nothing: no scan, as in one process)
        scan = getattr(tokenizer, "divergence_share", None) if config.input_format != "spans" else None
        share = scan(rank, world) if scan is not None else None
    except Exception as exc:
        failure = failure_from(exc, rank=rank, phase="tokenize plan", item=None)
    planned = agree(group, failure, phase="tokenize plan", payload=(mine, share))
    shares = [s for _, s in planned]
    if any(shares):  # the same on every rank: all join the shares, or none
        try:
            tokenizer.join_divergence_shares(shares, store=rank == 0)
        except Exception as exc:
            failure = failure_from(exc, rank=rank, phase="tokenize plan", item=None)
        agree(group, failure, phase="tokenize plan")
    record = tokenizer.record(append_eod=config.append_eod)
    runs = _number_lines(runs, [counts for counts, _ in planned])
    parts_dir = output + PARTS_SUFFIX
    part = os.path.join(parts_dir, f"part-{rank:05d}-of-{world:05d}")
    summary = None
    try:
        if runs[rank]:
            summary = _tokenize_part(runs[rank], part, config, tokenizer, record)
    except Exception as exc:
        failure = failure_from(exc, rank=rank, phase="tokenize", item=f"tokenizing part {rank} of {world}")
    summaries = agree(group, failure, phase="tokenize", payload=summary)
    documents = sum(s["documents"] for s in summaries if s)
    tokens = sum(s["tokens"] for s in summaries if s)
    empty = sum(s["empty_documents"] for s in summaries if s)
    routed = sum(s.get("routed", 0) for s in summaries if s)
    skipped: Counter = Counter()
    for s in summaries:
        if s:
            skipped.update(s["skipped"])
    # of chat and spans input: the tokens in the loss, and the assistant header every part resolved
    # the same way (from the tokenizer and template alone); None where the input has no mask
    loss_tokens = sum(s["loss_tokens"] for s in summaries if s) if config.input_format in RECORD_FORMATS else None
    prefix_tokens = next((s["assistant_prefix_tokens"] for s in summaries if s), None)
    metadata = store_metadata(record, files, config, documents=documents, tokens=tokens, empty=empty,
                              skipped=skipped, assistant_prefix_tokens=prefix_tokens)
    # the parts into one store: every rank copies its part's tokens into the store's .bin at its
    # offset (nothing passes through one rank), then rank 0 writes the .idx and renames
    parts = [os.path.join(parts_dir, f"part-{r:05d}-of-{world:05d}") for r in range(world) if runs[r]]
    sizes = [s["bin_bytes"] if s else 0 for s in summaries]
    writer, target = None, None
    if rank == 0:
        try:
            dtype = IndexedDataset(parts[0]).dtype if parts else dtype_for_vocab(record.vocab_size)
            writer = IndexedDatasetWriter(output, dtype=dtype)
            writer.reserve(sum(sizes))
            target = writer.temp_bin_path
        except Exception as exc:
            failure = failure_from(exc, rank=rank, phase="tokenize merge", item=f"merging the parts into {output}")
    try:
        target = agree(group, failure, phase="tokenize merge", payload=target)[0]
        try:
            if runs[rank]:
                _copy_into(part + ".bin", target, sum(sizes[:rank]))
        except Exception as exc:
            failure = failure_from(exc, rank=rank, phase="tokenize merge", item=f"tokenizing part {rank} of {world}")
        agree(group, failure, phase="tokenize merge")
        if rank == 0:
            try:
                for path in parts:
                    writer.append_store(IndexedDataset(path), copy_bytes=False)
                writer.finalize(metadata)
                shutil.rmtree(parts_dir, ignore_errors=True)
            except Exception as exc:
                failure = failure_from(exc, rank=rank, phase="tokenize merge", item=f"merging the parts into {output}")
    finally:
        if writer is not None:
            writer.abort()  # nothing once finalized; else the hidden .bin goes
    agree(group, failure, phase="tokenize merge")
    return TokenizeSummary(prefix=output, tokenizer=record, num_files=len(files), num_documents=documents,
                           num_tokens=tokens, num_empty=empty, skipped=dict(metadata["source"]["skipped"]),
                           elapsed_s=time.perf_counter() - started,
                           ranks=world, parts_kept=sum(1 for s in summaries if s and s.get("kept")),
                           routed_documents=routed, loss_tokens=loss_tokens, assistant_prefix_tokens=prefix_tokens,
                           **engine_report(tokenizer, config),
                           **dict(zip(("workers", "threads"), config.parallelism(tokenizer))))


def _copy_into(source: str, target: str, offset: int) -> None:
    """Write the bytes of file ``source`` into file ``target`` from byte ``offset``, durably."""
    with open(source, "rb") as src, open(target, "r+b") as dst:
        dst.seek(offset)
        shutil.copyfileobj(src, dst, 1 << 24)
        dst.flush()
        os.fsync(dst.fileno())


def _tokenize_part(pieces: list[InputPiece], part: str, config: TokenizeConfig, tokenizer, record) -> dict:
    """Tokenize this rank's pieces into ``part`` (or keep the part a finished run left with the
    same inputs and settings); returns its counts."""
    wanted = {"format": PART_FORMAT, "version": PART_VERSION, "pieces": [_describe(p) for p in pieces],
              "settings": _settings(config, record.to_dict())}
    manifest = part + ".json"
    if os.path.isfile(manifest) and os.path.isfile(idx_path(part)):
        try:
            with open(manifest, encoding="utf-8") as f:
                done = json.load(f)
        except (OSError, ValueError):
            done = None
        if done is not None and {k: done.get(k) for k in wanted} == json.loads(json.dumps(wanted)):
            return {**done["counts"], "kept": True, "bin_bytes": os.path.getsize(part + ".bin")}
    os.makedirs(os.path.dirname(part), exist_ok=True)
    if os.path.exists(manifest):
        os.remove(manifest)  # an old part is not reused until its new manifest is written
    own_files = list({p.source.path: p.source for p in pieces}.values())
    summary = tokenize_pieces(own_files, pieces, part, config, tokenizer=tokenizer)
    counts = {"documents": summary.num_documents, "tokens": summary.num_tokens, "empty_documents": summary.num_empty,
              "skipped": dict(summary.skipped), "bin_bytes": os.path.getsize(part + ".bin"),
              "routed": summary.routed_documents, "loss_tokens": summary.loss_tokens,
              "assistant_prefix_tokens": summary.assistant_prefix_tokens}
    write_json_atomic(manifest, {**wanted, "counts": counts})
    return counts


__all__ = ["PARTS_SUFFIX", "tokenize_on_ranks"]
