"""The mixture audit: what each step really served, and a fingerprint of every global batch.

One JSON object per line. The first line describes the run; then one line per optimizer step::

    {"format": "tokenloom-audit", "version": 1, "build_key": "...", "seq_length": 8,
     "datasets": ["web", "code"], "weights": [0.75, 0.25]}
    {"step": 0, "consumed_samples": 0, "global_batch_size": 4, "tokens": [24, 8],
     "cumulative_tokens": [24, 8], "target_weights": [0.75, 0.25], "drift": [0.0, 0.0],
     "fingerprint": "3f0c..."}

``tokens`` counts ``seq_length`` tokens per sample of each dataset in the step (a schedule
that changes the sequence length serves length runs, each with its own: the header then also
lists ``seq_lengths``, one per dataset); ``drift`` is the
realised share of all tokens so far minus the share the weights in force at each step asked for
(after a weight change the expectation follows the new weights from that step on). The
fingerprint hashes the build key and the global batch's ``(dataset_id, sample_id)`` pairs in
stream order, so any rank computes it
without reading tokens, and two runs that serve the same samples in the same order agree.
On resume the next step's fingerprint is checked against the log when the log has that step.
A step served right after positions taken out of the stream (skipped steps, quarantined
documents) also has ``"skipped": [[begin, end], ...]`` (underlying stream positions) and
``"skipped_samples"``; :func:`summarize_skips` totals them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenloom.errors import ConfigError, FormatError

AUDIT_FORMAT = "tokenloom-audit"
AUDIT_VERSION = 1


def batch_fingerprint(build_key: str, dataset_ids: np.ndarray, sample_ids: np.ndarray) -> str:
    """16 hex digits of BLAKE2b over the build key and the batch's (dataset, sample) pairs."""
    digest = hashlib.blake2b(build_key.encode("utf-8"), digest_size=8)
    pairs = np.stack([np.asarray(dataset_ids, dtype="<i8"), np.asarray(sample_ids, dtype="<i8")], axis=1)
    digest.update(np.ascontiguousarray(pairs).tobytes())  # (G, 2) little-endian int64
    return digest.hexdigest()


class MixtureAudit:
    """Records every step a loader starts; writes a JSON-lines log when given a path.

    Give the path on one rank only (the library never decides which rank logs).
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self.records: list[dict[str, Any]] = []
        self._cumulative: np.ndarray | None = None
        self._expected: np.ndarray | None = None
        self._logged: dict[int, dict[str, Any]] | None = None
        self._header_written = self.path is not None and os.path.isfile(self.path) and os.path.getsize(self.path) > 0

    def _header(self, source) -> dict[str, Any]:
        header = {"format": AUDIT_FORMAT, "version": AUDIT_VERSION, "build_key": source.build_key,
                  "seq_length": source.seq_length, "datasets": [d.name for d in source.datasets],
                  "weights": [d.weight for d in source.datasets]}
        widths = _seq_lengths(source)
        if (widths != source.seq_length).any():  # a schedule's length runs (written only then)
            header["seq_lengths"] = [int(w) for w in widths]
        budgets = [getattr(d, "budget_tokens", None) for d in source.datasets]
        if any(b is not None for b in budgets):
            header["budget_tokens"] = budgets
        return header

    def record_step(self, sampler) -> dict[str, Any]:
        """Audit the step ``sampler`` is about to serve (call before its first micro-batch)."""
        stream, source = sampler.stream, sampler.source
        num_datasets = len(source.datasets)
        widths = _seq_lengths(source)  # (datasets,) tokens per sample
        if self._cumulative is None:
            self._cumulative = stream.samples_reached(sampler.step_start) * widths
            self._expected = expected_samples(stream, sampler.step_start) * widths
        dataset_ids, sample_ids = stream.locate(sampler.global_batch_positions())
        tokens = np.bincount(dataset_ids, minlength=num_datasets) * widths
        target = np.asarray(stream.target_weights(sampler.step_start))
        self._cumulative = self._cumulative + tokens
        self._expected = self._expected + target * float(tokens.sum())
        total = max(1, int(self._cumulative.sum()))
        drift = (self._cumulative - self._expected) / total
        record = {"step": sampler.step, "consumed_samples": sampler.step_start,
                  "global_batch_size": int(dataset_ids.shape[0]),
                  "tokens": [int(t) for t in tokens], "cumulative_tokens": [int(t) for t in self._cumulative],
                  "target_weights": [float(t) for t in target], "drift": [float(d) for d in drift],
                  "fingerprint": batch_fingerprint(source.build_key, dataset_ids, sample_ids)}
        phase = stream.phase_of(sampler.step_start)
        if phase is not None:  # a schedule's phase, numbered from 1 as the config and the dry run do
            record["phase"] = phase + 1
        if stream.segments:  # the step a weight change at run time starts (a ramp's steps are not changes)
            first = int(stream.underlying(np.array([sampler.step_start]))[0])
            if any(segment.start == first for segment in stream.segments):
                record["weights_changed"] = True
        # positions taken out of the stream (skipped steps, quarantined documents) since the last
        # position served before this step, up to this step's last: this step jumped them
        if stream.skips or stream.quarantined.shape[0]:
            start = sampler.step_start
            last = start + int(dataset_ids.shape[0]) - 1
            edges = stream.underlying(np.array([max(start - 1, 0), last]))
            low = int(edges[0]) + 1 if start > 0 else 0
            skipped = stream.skipped_between(low, int(edges[1]) + 1)
            if skipped:
                record["skipped"] = [[a, b] for a, b in skipped]
                record["skipped_samples"] = sum(b - a for a, b in skipped)
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                if not self._header_written:
                    f.write(json.dumps(self._header(source)) + "\n")
                    self._header_written = True
                f.write(json.dumps(record) + "\n")
        return record

    def check_resume(self, sampler) -> None:
        """After a resume: ConfigError if the log has the next step and its fingerprint differs."""
        self._cumulative = None
        if self.path is None or not os.path.isfile(self.path):
            return
        log = read_audit_log(self.path)
        if log.header["build_key"] != sampler.source.build_key:
            raise ConfigError(f"{self.path}: the audit log is of build {log.header['build_key'][:16]}..., "
                              f"the loader serves build {sampler.source.build_key[:16]}...")
        logged = log.step(sampler.step)
        if logged is None or sampler.micro_batch:
            return
        dataset_ids, sample_ids = sampler.stream.locate(sampler.global_batch_positions())
        fingerprint = batch_fingerprint(sampler.source.build_key, dataset_ids, sample_ids)
        if fingerprint != logged["fingerprint"]:
            raise ConfigError(
                f"{self.path}: step {sampler.step} was logged with fingerprint {logged['fingerprint']} "
                f"but the resumed loader would serve {fingerprint}; the resumed stream differs from the "
                "logged run (another state, build, or blend weights?)")
        # the log will get this step again; drop the later lines so it stays one run
        log.truncate_before(sampler.step)


def _seq_lengths(source) -> np.ndarray:
    """``(datasets,)`` int64: tokens per sample of each dataset of ``source`` (a schedule's
    length runs have their own; any other source, its ``seq_length``)."""
    widths = getattr(source, "seq_lengths", None)
    if widths is None:
        return np.full(len(source.datasets), source.seq_length, dtype=np.int64)
    return np.asarray(widths, dtype=np.int64)


def expected_samples(stream, position: int) -> np.ndarray:
    """(num_datasets,) float64: samples the weights in force asked of each dataset in ``[0, position)``
    (what the log's steps summed before a resume at ``position``)."""
    if stream.schedule is not None:
        return _scheduled_expectation(stream, position)
    starts = [stream.logical(s.start) for s in stream.segments]  # segments start at underlying positions
    bounds = [0] + [start for start in starts if start < position] + [position]
    expected = np.zeros(len(stream.source.datasets))
    for begin, end in itertools.pairwise(bounds):
        expected += np.asarray(stream.target_weights(begin)) * (end - begin)
    return expected


#: Ramp steps whose targets are summed at once (a block of steps x datasets float64).
_RAMP_BLOCK = 4096


def _scheduled_expectation(stream, position: int) -> np.ndarray:
    """:func:`expected_samples` on a mixture schedule, as the steps summed it: each step's target
    times its samples. The target is constant between phase boundaries and weight changes, so such
    a stretch counts at once; in a ramp it moves every step of the build's batch schedule, so a
    ramp's steps are summed block by block (O(ramp steps x datasets), once per resume)."""
    from tokenloom.index.batch_sizes import StepRuns

    plan = stream.schedule.plan
    num_datasets = len(stream.source.datasets)
    end = (int(stream.underlying(np.array([position]))[0]) if position < stream.num_samples
           else stream.underlying_samples)
    cuts = {0, end, *(int(b) for b in plan.boundaries)}
    for k, segment in enumerate(stream.segments):
        cuts.update((segment.start, stream.changes.segment_end(k)))
    cuts = sorted(c for c in cuts if 0 <= c <= end)
    runs = StepRuns.of(plan.batch_steps)
    expected = np.zeros(num_datasets)
    for a, b in itertools.pairwise(cuts):
        if a >= b:
            continue
        phase = int(plan.phase_of(min(a, plan.num_samples - 1)))
        if stream.changes.change_holding(a) is not None or plan.ramps[phase] is None or a >= plan.num_samples:
            expected += np.asarray(stream.changes.target_at(a)) * float(stream.served_between(a, b))
            continue
        first, last = (int(s) for s in runs.step_at(np.array([a, b - 1])))
        for block in range(first, last + 1, _RAMP_BLOCK):
            steps = np.arange(block, min(last + 1, block + _RAMP_BLOCK), dtype=np.int64)
            begins = np.clip(runs.step_start(steps), a, b)
            ends = np.clip(runs.step_start(steps + 1), a, b)
            served = stream.served_between(begins, ends).astype(np.float64)  # (n,)
            expected += (stream.schedule.targets_at(begins) * served[:, None]).sum(axis=0)
    return expected


@dataclass
class AuditLog:
    """A parsed audit log."""

    path: str
    """The file it was read from."""
    header: dict[str, Any]
    """The first line: format, version, build key, seq_length, dataset names and weights."""
    records: list[dict[str, Any]]
    """One dict per logged step, in file order."""

    def step(self, step: int) -> dict[str, Any] | None:
        """The last record of ``step``, or None."""
        for record in reversed(self.records):
            if record["step"] == step:
                return record
        return None

    def truncate_before(self, step: int) -> None:
        """Rewrite the file keeping only steps before ``step``."""
        kept = [r for r in self.records if r["step"] < step]
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.header) + "\n")
            for record in kept:
                f.write(json.dumps(record) + "\n")
        self.records = kept


def read_audit_log(path: str | os.PathLike) -> AuditLog:
    """Parse a log written by :class:`MixtureAudit`; FormatError on anything else."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as exc:
        raise FormatError(f"{path}: cannot read audit log: {exc.strerror or exc}") from exc
    try:
        objects = [json.loads(line) for line in lines]
    except ValueError as exc:
        raise FormatError(f"{path}: not a JSON-lines audit log: {exc}") from exc
    if not objects or objects[0].get("format") != AUDIT_FORMAT:
        raise FormatError(f"{path}: first line is not a {AUDIT_FORMAT!r} header; is this a tokenloom audit log?")
    if objects[0].get("version") != AUDIT_VERSION:
        raise FormatError(f"{path}: audit log version {objects[0].get('version')!r}, expected {AUDIT_VERSION}")
    return AuditLog(path=path, header=objects[0], records=objects[1:])


#: Per-dataset fields of a record that add up over a store's length runs.
_ADDITIVE = ("tokens", "cumulative_tokens", "target_weights", "drift")


def by_store(log: AuditLog) -> AuditLog:
    """``log`` with one dataset per store: a schedule that changes the sequence length serves each
    such store as several length runs (the header's ``seq_lengths``), and the runs of one store
    are summed into it (tokens, targets and drifts add: in any step at most one run of a store
    is served). A log without runs is returned as it is."""
    if "seq_lengths" not in log.header:
        return log
    names = list(log.header["datasets"])
    stores = list(dict.fromkeys(names))
    group = np.array([stores.index(name) for name in names], dtype=np.int64)  # (datasets,)

    def merged(values) -> list:
        out = np.zeros(len(stores), dtype=np.float64)
        np.add.at(out, group, np.asarray(values, dtype=np.float64))
        return out.tolist()

    header = {**log.header, "datasets": stores, "weights": merged(log.header["weights"])}
    header.pop("seq_lengths")
    records = []
    for record in log.records:
        record = dict(record)
        for key in _ADDITIVE:
            record[key] = merged(record[key])
        record["tokens"] = [int(t) for t in record["tokens"]]
        record["cumulative_tokens"] = [int(t) for t in record["cumulative_tokens"]]
        records.append(record)
    return AuditLog(path=log.path, header=header, records=records)


def summarize_audit(log: AuditLog) -> list[dict[str, Any]]:
    """One row per dataset (per store, where a schedule's length runs split one: :func:`by_store`):
    name, target weight, realised tokens and share, final drift, max |drift|; and, when the build
    gave token budgets, the budget and the share of it served."""
    log = by_store(log)
    names = log.header["datasets"]
    if not log.records:
        return [{"dataset": n, "target": w, "tokens": 0, "realised": 0.0, "drift": 0.0, "max_abs_drift": 0.0}
                for n, w in zip(names, log.header["weights"])]
    last = log.records[-1]
    total = max(1, sum(last["cumulative_tokens"]))
    rows = []
    budgets = log.header.get("budget_tokens")
    for d, name in enumerate(names):
        row = {"dataset": name, "target": last["target_weights"][d],
               "tokens": last["cumulative_tokens"][d], "realised": last["cumulative_tokens"][d] / total,
               "drift": last["drift"][d],
               "max_abs_drift": max(abs(r["drift"][d]) for r in log.records)}
        if budgets is not None:  # realised tokens against the dataset's budget
            row["budget_tokens"] = budgets[d]
            row["budget_used"] = None if not budgets[d] else last["cumulative_tokens"][d] / budgets[d]
        rows.append(row)
    return rows


def summarize_skips(log: AuditLog) -> dict[str, Any]:
    """Samples the logged steps jumped (skipped steps, quarantined documents): their total, the
    ranges of underlying positions, and the steps served right after each."""
    ranges, steps = [], []
    for record in log.records:
        if record.get("skipped"):
            ranges += [list(r) for r in record["skipped"]]
            steps.append(record["step"])
    return {"skipped_samples": sum(b - a for a, b in ranges), "ranges": ranges, "steps": steps}


__all__ = ["AUDIT_FORMAT", "AUDIT_VERSION", "AuditLog", "MixtureAudit", "batch_fingerprint", "by_store",
           "read_audit_log", "summarize_audit", "summarize_skips"]
