"""The batch pipeline: ``(dataset_id, sample_id)`` pairs -> every field one rank consumes.

Every loader in serve -- :class:`~tokenloom.serve.loader.RankLoader` (and the JAX ``HostLoader``
on top of it), the PyTorch ``ServeDataset`` -- turns a micro-batch into numpy fields with one
:class:`BatchPipeline`; the framework adapters only wrap the arrays. For ``B`` pairs it

1. reads the rows: ``source.read_samples`` -> ``(B, seq_length + add_extra_token)`` tokens (with
   ``inter_document_masking``, ``source.read_pieces``: the rows and their document pieces, read by
   the same gather);
2. builds megatron-core's fields (:func:`~tokenloom.serve.samples.build_fields`), each row with
   its own dataset's EOD id, and the document-boundary fields from the pieces; where a store of
   the micro-batch carries a loss mask (``source.read_loss_masks``), ``loss_mask`` is multiplied
   by the mask of each label (:func:`label_loss_mask`);
3. keeps the fields a pipeline stage consumes (``fields``; None keeps all);
4. cuts the context-parallel rank's two sequence chunks
   (:func:`~tokenloom.serve.topology.context_parallel_slice`; ``cu_seqlens`` and ``max_seqlen``
   describe the whole sample and stay whole, as Megatron-LM leaves them; the packed THD form is
   cut per document in step 6 instead);
5. adds ``dataset_id``, ``(B,)`` in megatron-core's dtype (int16, int32 beyond 32766 datasets);
6. with ``boundary_format="thd"``, packs the micro-batch's per-sample boundaries into one sequence
   (:mod:`tokenloom.serve.packed`), and with context parallelism keeps this rank's chunks of every
   document: the only step whose output length varies from one micro-batch to the next.

Steps 1-5 give fixed shapes per sample (:meth:`BatchPipeline.read_samples_fields`): that is what
crosses process boundaries (DataLoader workers reading a whole step, the tensor-parallel
broadcast) and what :meth:`BatchPipeline.schema` describes. Step 6 (:meth:`BatchPipeline.finish`)
runs where a micro-batch is final, on numpy arrays or on torch tensors on the device, so a tensor
peer rebuilds the packed boundaries from the broadcast ``(B, S + 1)`` ones instead of receiving a
field whose length it cannot know in advance: one fixed-shape broadcast per field, no size
handshake.

:meth:`BatchPipeline.schema` is the shape and dtype of every field of a micro-batch (what a
tensor-parallel broadcast receiver allocates). It is not a table kept beside the code: it runs
steps 2-5 on one synthetic row of the source's length, so it changes whenever the pipeline does
and cannot drift from it. Every field's first axis is the batch, which the schema sets to the
micro-batch size. :func:`read_fields` and :func:`field_schema` are the same for a one-off call.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.index.megatron_blend import megatron_dataset_id_dtype
from tokenloom.serve.fim import FimTransform
from tokenloom.serve.packed import pack_documents, partition_documents
from tokenloom.serve.samples import SampleOptions, build_fields
from tokenloom.serve.topology import context_parallel_slice
from tokenloom.source import SampleSource
from tokenloom.source.provenance import store_identity
from tokenloom.validate import is_integer


class FieldSpec(NamedTuple):
    """Shape and dtype of one field of a micro-batch."""

    shape: tuple[int, ...]
    """The field's shape; its first axis is the micro-batch."""
    dtype: np.dtype
    """The numpy dtype the pipeline returns."""


class BatchPipeline:
    """``(dataset_id, sample_id)`` pairs of ``source`` -> the numpy fields one rank consumes.

    ``fields``: the names a pipeline stage keeps (``RankPlan.fields``); None keeps all of them,
    and ``dataset_id`` is always there. ``cp_size``/``cp_rank`` cut the sequence axes to one
    context-parallel rank's chunks. The per-dataset constants (EOD ids, the dataset id dtype)
    are looked up once here, not per micro-batch.
    """

    def __init__(self, source: SampleSource, *, options: SampleOptions = SampleOptions(),
                 fields: tuple[str, ...] | None = None, cp_size: int = 1, cp_rank: int = 0) -> None:
        options = with_build_fim(source, options)
        self.source = source
        self.options = options
        self.fields = None if fields is None else tuple(fields)
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self._packed = options.boundary_format == "thd"  # SampleOptions: "thd" implies inter_document_masking
        """Packed THD: a context-parallel rank's share is cut per document in step 6, not here."""
        self._eod_ids = np.array([-1 if d.eod_id is None else d.eod_id for d in source.datasets],
                                 dtype=np.int64)  # (num_datasets,) -1: no EOD id
        # megatron-core's BlendedDataset hands out int16 dataset ids (int32 beyond 32766 datasets)
        self._id_dtype = megatron_dataset_id_dtype(len(source.datasets))
        if options.inter_document_masking:
            check_pieces(source)
        self._fim = None if options.fim is None else fim_datasets(source, options)
        """(num_datasets,) bool: the datasets whose samples FIM permutes (None: no FIM)."""
        if self._fim is not None:
            check_fim_unmasked(source, self._fim)
        self._masks = callable(getattr(source, "read_loss_masks", None))
        """The source can read its stores' loss masks (a source of tokenloom.source can)."""

    def read(self, dataset_ids, sample_ids) -> dict[str, np.ndarray]:
        """Every field of the micro-batch of samples ``(dataset_ids[k], sample_ids[k])``; see the
        module docstring (steps 1-6)."""
        return self.finish(self.read_samples_fields(dataset_ids, sample_ids))

    def finish(self, fields: dict) -> dict:
        """Step 6 on one micro-batch's fields: :func:`finish_micro_batch`."""
        return finish_micro_batch(fields, self.options, cp_size=self.cp_size, cp_rank=self.cp_rank)

    def read_samples_fields(self, dataset_ids, sample_ids) -> dict[str, np.ndarray]:
        """Steps 1-5: every field of the samples ``(dataset_ids[k], sample_ids[k])``, per sample
        (fixed shapes, any number of micro-batches at once)."""
        dataset_ids = np.asarray(dataset_ids, dtype=np.int64)  # (B,)
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        if self.options.inter_document_masking:
            tokens, ends, counts = self.source.read_pieces(dataset_ids, sample_ids)
            tokens, (ends, counts), permuted = self._permuted(tokens, dataset_ids, sample_ids, (ends, counts))

            def describe(row: int) -> str:
                return f"{self.source.datasets[int(dataset_ids[row])].name}: sample {int(sample_ids[row])}"

            return self.from_rows(tokens, dataset_ids, pieces=(ends, counts), describe_row=describe,
                                  permuted=permuted, store_mask=self._store_masks(dataset_ids, sample_ids))
        rows = self.source.read_samples(dataset_ids, sample_ids)  # (B, seq_length + add_extra_token)
        rows, _, permuted = self._permuted(rows, dataset_ids, sample_ids, None)
        return self.from_rows(rows, dataset_ids, permuted=permuted,
                              store_mask=self._store_masks(dataset_ids, sample_ids))

    def _store_masks(self, dataset_ids: np.ndarray, sample_ids: np.ndarray) -> np.ndarray | None:
        """``(B, width)`` uint8: the stores' loss masks of the rows, column for column; None when
        no store of the micro-batch has one (:meth:`BlendedSource.read_loss_masks`)."""
        return self.source.read_loss_masks(dataset_ids, sample_ids) if self._masks else None

    def _permuted(self, rows: np.ndarray, dataset_ids: np.ndarray, sample_ids: np.ndarray, pieces):
        """FIM on the rows of the datasets it permutes: ``(rows, pieces, permuted)``, the pieces
        of permuted rows following their end-of-document tokens, ``permuted`` ``(B,)`` bool (None
        without FIM)."""
        if self._fim is None:
            return rows, pieces, None
        permuted = self._fim[dataset_ids]  # (B,)
        if not permuted.any():
            return rows, pieces, permuted
        fim = self.options.fim
        rows = rows.copy()
        lengths = unpadded_lengths(rows[permuted], self.source.pad_id)
        rows[permuted] = fim.apply_rows(rows[permuted], dataset_ids[permuted], sample_ids[permuted], lengths)
        if pieces is not None:
            ends, counts = pieces[0].copy(), pieces[1].copy()
            ends[permuted], counts[permuted] = fim.pieces(rows[permuted], lengths)
            pieces = (ends, counts)
        return rows, pieces, permuted

    def from_rows(self, rows: np.ndarray, dataset_ids, *, pieces=None, describe_row=None,
                  permuted: np.ndarray | None = None, store_mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Steps 2-5 on rows already read: ``rows[k]`` is a sample of dataset ``dataset_ids[k]``;
        ``pieces``: the rows' ``(ends, counts)`` (:class:`~tokenloom.source.protocol.PieceRows`);
        ``describe_row``: what an error calls row k; ``permuted``: ``(B,)`` bool, the rows FIM
        permuted (their FIM pad tokens are outside the loss); ``store_mask``: ``rows``-shaped 0/1,
        the stores' loss masks of the rows' tokens (:func:`label_loss_mask` aligns them with the
        labels; None: every token is in the loss)."""
        dataset_ids = np.asarray(dataset_ids, dtype=np.int64)  # (B,)
        out = build_fields(rows, eod_ids=self._eod_ids[dataset_ids], pad_id=self.source.pad_id,
                           add_extra_token=self.source.add_extra_token, options=self.options, pieces=pieces,
                           describe_row=describe_row)
        if permuted is not None and permuted.any():  # a label that is FIM's pad carries no loss
            labels = rows[:, 1:] if self.source.add_extra_token else \
                np.concatenate([rows[:, 1:], np.full((rows.shape[0], 1), -1, dtype=rows.dtype)], axis=1)
            out["loss_mask"][permuted[:, None] & (labels == self.options.fim.pad_id)] = 0.0
        if store_mask is not None:
            out["loss_mask"] *= label_loss_mask(store_mask, self.source.add_extra_token)
        if self.fields is not None:
            out = {name: value for name, value in out.items() if name in self.fields}
        if self.cp_size > 1 and not self._packed:  # (B, S) -> (B, S / cp); attention_mask -> (B, 1, S / cp, S)
            out = context_parallel_slice(out, self.cp_size, self.cp_rank)
        out["dataset_id"] = dataset_ids.astype(self._id_dtype)  # (B,)
        return out

    def schema(self, micro_batch_size: int, seq_length: int | None = None) -> dict[str, FieldSpec]:
        """Name -> :class:`FieldSpec` of every field :meth:`read_samples_fields` returns for
        ``micro_batch_size`` samples (what crosses a process boundary), in the same order:
        :meth:`from_rows` on one synthetic row, its first axis set to ``micro_batch_size``.
        ``seq_length``: of the samples (a schedule's phase may have its own), else the source's."""
        if not is_integer(micro_batch_size) or micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size={micro_batch_size!r}; expected a positive integer")
        seq_length = self.source.seq_length if seq_length is None else seq_length
        width = seq_length + int(self.source.add_extra_token)
        row = np.zeros((1, width), dtype=np.int64)  # (1, width)
        pieces = (np.full((1, width + 1), width, dtype=np.int32), np.ones(1, dtype=np.int32))  # one document
        one = self.from_rows(row, np.zeros(1, dtype=np.int64), pieces=pieces)
        return {name: FieldSpec((int(micro_batch_size), *value.shape[1:]), value.dtype) for name, value in one.items()}


def read_fields(source: SampleSource, dataset_ids, sample_ids, *, options: SampleOptions = SampleOptions(),
                fields: tuple[str, ...] | None = None, cp_size: int = 1, cp_rank: int = 0) -> dict[str, np.ndarray]:
    """Every field of the samples ``(dataset_ids[k], sample_ids[k])`` of ``source``:
    ``BatchPipeline(source, ...).read(dataset_ids, sample_ids)``."""
    return BatchPipeline(source, options=options, fields=fields, cp_size=cp_size,
                         cp_rank=cp_rank).read(dataset_ids, sample_ids)


def field_schema(source: SampleSource, micro_batch_size: int, *, options: SampleOptions = SampleOptions(),
                 fields: tuple[str, ...] | None = None, cp_size: int = 1,
                 seq_length: int | None = None) -> dict[str, FieldSpec]:
    """Name -> :class:`FieldSpec` of every field :func:`read_fields` returns for a micro-batch of
    ``micro_batch_size`` samples (of ``seq_length`` tokens: a schedule's phase may have its own;
    None: the source's): ``BatchPipeline(source, ...).schema(micro_batch_size, seq_length)``."""
    return BatchPipeline(source, options=options, fields=fields, cp_size=cp_size).schema(micro_batch_size,
                                                                                         seq_length)


def finish_micro_batch(fields: dict, options: SampleOptions, seq_length: int | None = None, *, cp_size: int = 1,
                       cp_rank: int = 0) -> dict:
    """Step 6 on one micro-batch's per-sample fields (numpy arrays or torch tensors): with
    ``boundary_format="thd"`` the packed boundaries (:func:`~tokenloom.serve.packed.pack_documents`),
    and with context parallelism this rank's share of the packed documents
    (:func:`~tokenloom.serve.packed.partition_documents`); else unchanged. ``seq_length`` None:
    the micro-batch's own, read from its ``cu_seqlens`` ``(B, S + 1)`` (a schedule's phases may
    differ)."""
    if options.boundary_format != "thd":
        return fields
    if seq_length is None:
        seq_length = int(fields["cu_seqlens"].shape[1]) - 1
    if cp_size > 1:
        return partition_documents(fields, seq_length, cp_size, cp_rank)
    return pack_documents(fields, seq_length)


def fim_datasets(source: SampleSource, options: SampleOptions) -> np.ndarray:
    """``(num_datasets,)`` bool: the datasets of ``source`` whose samples ``options.fim``
    permutes (``fim_stores``, by store prefix however spelt; all without it). ConfigError for a
    store not in the source, or a dataset whose end-of-document id is not FIM's (its pieces
    would not be its documents)."""
    names = [d.name for d in source.datasets]
    if options.fim_stores is None:
        chosen = np.ones(len(names), dtype=bool)
    else:
        identities = [store_identity(name) for name in names]
        chosen = np.zeros(len(names), dtype=bool)
        for prefix in options.fim_stores:
            wanted = store_identity(prefix)
            found = [d for d, identity in enumerate(identities) if identity == wanted]
            if not found:
                raise ConfigError(f"SampleOptions.fim_stores names {prefix!r}, which is not a store of this split; "
                                  f"its stores are {names[:10]}{' ...' if len(names) > 10 else ''}")
            chosen[found] = True
    for d in np.flatnonzero(chosen).tolist():
        eod = source.datasets[d].eod_id
        if eod is not None and eod != options.fim.eod_id:
            raise ConfigError(f"{names[d]}: its documents end with id {eod} but fim_extra_tokens['eod'] is id "
                              f"{options.fim.eod_id}; FIM splits a sample at that token: give the store's "
                              "end-of-document token")
    return chosen


def unpadded_lengths(rows: np.ndarray, pad_id: int) -> np.ndarray | None:
    """``(B,)`` int64: each row's columns before its trailing run of the source's pad id (a
    best-fit sample's documents; FIM permutes those alone), or None when the pad id is a token id
    (not negative: a row cannot tell padding from tokens; concatenated samples have none)."""
    if pad_id >= 0 or not rows.size:
        return None
    real = rows != pad_id  # (B, W)
    width = rows.shape[1]
    return np.where(real.any(axis=1), width - np.argmax(real[:, ::-1], axis=1), 0).astype(np.int64)


def with_build_fim(source: SampleSource, options: SampleOptions) -> SampleOptions:
    """``options``, with the FIM of the build's config (``source.fim``, a
    :class:`~tokenloom.source.fim_options.FimSettings`) when they set none: its stores that are in
    this split are permuted (a split without any is served plain). FIM set in ``options`` wins."""
    settings = getattr(source, "fim", None)
    if options.fim is not None or settings is None:
        return options
    stores = None
    if settings.stores is not None:
        here = {store_identity(d.name) for d in source.datasets}
        stores = tuple(p for p in settings.stores if store_identity(p) in here)
        if not stores:
            return options
    transform = FimTransform(settings.options, settings.codec, seed=settings.seed)
    return dataclasses.replace(options, fim=transform, fim_stores=stores)


def label_loss_mask(store_mask: np.ndarray, add_extra_token: bool) -> np.ndarray:
    """``(B, S)`` uint8: the stores' mask of each label, from the mask of the row's tokens
    ``(B, S + add_extra_token)``. Label ``t`` is token ``t + 1``, so the mask of token ``t + 1``
    decides whether predicting it is in the loss, as Megatron-LM's ``SFTDataset`` makes
    ``loss_mask = labels != IGNORE_INDEX`` with ``labels = targets[1:]``. Without the extra token
    the last label is padding (outside the loss through the padding mask): its entry here is 1."""
    if add_extra_token:
        return store_mask[:, 1:]
    return np.concatenate([store_mask[:, 1:], np.ones((store_mask.shape[0], 1), dtype=store_mask.dtype)], axis=1)


def check_fim_unmasked(source: SampleSource, permuted: np.ndarray) -> None:
    """ConfigError when a dataset FIM permutes has a loss mask: FIM re-tokenizes a sample's text
    at character cuts, so a token of the result has no token of the store whose mask it would
    take. Serve such stores without FIM (``fim_stores`` naming the others)."""
    has_mask = getattr(source, "has_loss_mask", None)
    if not callable(has_mask):
        return
    masked = [source.datasets[d].name for d in np.flatnonzero(permuted).tolist() if has_mask(d)]
    if masked:
        raise ConfigError(f"fill-in-the-middle (SampleOptions.fim, or the build config's fim) would permute "
                          f"{masked[:5]}{' ...' if len(masked) > 5 else ''}, whose stores carry a loss mask "
                          "(PREFIX.mask); FIM re-tokenizes a sample's text, so its tokens have no mask to take: "
                          "name only unmasked stores among the stores FIM permutes")


def check_pieces(source: SampleSource) -> None:
    """ConfigError when ``source`` cannot say where its samples' documents end (it has no
    ``read_pieces``), which ``inter_document_masking`` needs."""
    if not callable(getattr(source, "read_pieces", None)):
        raise ConfigError(
            f"inter_document_masking needs each sample's document pieces, but {type(source).__name__} has no "
            "read_pieces (only tokens); serve a split of tokenloom.build or a source of tokenloom.source, or "
            "serve without inter_document_masking")


def check_eod(source: SampleSource, options: SampleOptions) -> None:
    """ConfigError when ``options`` act on end-of-document tokens but a dataset has no EOD id."""
    if not (options.eod_mask_loss or options.reset_position_ids or options.reset_attention_mask):
        return
    missing = [d.name for d in source.datasets if d.eod_id is None]
    if missing:
        raise ConfigError(
            f"{options} act on end-of-document tokens but {missing} have no EOD id (no tokenizer record "
            "in PREFIX.meta.json); pass eod_id= when building the source, or turn those options off")


__all__ = ["BatchPipeline", "FieldSpec", "check_eod", "check_fim_unmasked", "check_pieces", "field_schema",
           "fim_datasets", "finish_micro_batch", "label_loss_mask", "read_fields", "unpadded_lengths", "with_build_fim"]
