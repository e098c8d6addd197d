"""The packed (THD) form of a micro-batch's document boundaries, and its context-parallel split.

FlashAttention's varlen functions and Transformer Engine's ``PackedSeqParams(qkv_format="thd")``
take a micro-batch as one sequence of documents laid end to end and one ``cu_seqlens`` over it.
:func:`pack_documents` makes that from the per-sample fields the batch pipeline reads
(megatron-core's ``(B, S + 1)`` ``cu_seqlens``). With context parallelism, Transformer Engine's
kernels split every document, not the sequence: each document is padded to a multiple of
``2 * cp`` and cut into ``2 * cp`` chunks, and rank ``r`` takes chunks ``r`` and ``2 * cp - 1 - r``
of each (``thd_get_partitioned_indices``), which balances causal attention inside every document;
:func:`partition_documents` gives a rank exactly that share.

Both run where a micro-batch is final (:func:`tokenloom.serve.batch.finish_micro_batch`), on numpy
arrays or on torch tensors. The index arithmetic of the split runs in numpy on the boundaries
(``B x (S + 1)`` integers; a device tensor is copied to the host for it, as small as the batch's
``cu_seqlens``), and the tokens are gathered where they are.
"""

from __future__ import annotations

import numpy as np

from tokenloom.index.kernels import compiled, jit, numba_available

#: Per-token fields of a micro-batch (``(B, S)``) that the context-parallel split gathers, and
#: what a padding position inside a document gets.
SEQUENCE_FIELDS = {"tokens": 0, "labels": 0, "loss_mask": 0, "position_ids": None, "document_ids": None}


def pack_documents(fields: dict, seq_length: int) -> dict:
    """One micro-batch's per-sample boundaries as one packed (THD) sequence, what FlashAttention's
    varlen functions and Transformer Engine's ``PackedSeqParams(qkv_format="thd")`` take for the
    micro-batch's tokens laid end to end (``tokens.reshape(1, -1)``).

    ``cu_seqlens`` ``(B, S + 1)`` -> ``(D + 1,)`` int32: 0, then each sample's document ends
    (megatron-core's padding to ``S + 1`` removed) shifted by ``k * S`` for sample ``k``;
    ``max_seqlen`` ``(B,)`` -> a 0-d int32, the longest document. This is megatron-core's own
    ``flatten_batch_for_packed_sequences`` (which Megatron-LM's ``get_batch`` applies) without its
    leading axis of 1. Other fields are unchanged. Numpy arrays or torch tensors (on any device).
    """
    cu_seqlens = fields["cu_seqlens"]  # (B, S + 1)
    out = dict(fields)
    if hasattr(cu_seqlens, "index_select"):  # torch
        import torch

        last = (cu_seqlens == seq_length).to(torch.int32).argmax(dim=1)  # (B,) where each sample's S is
        columns = torch.arange(cu_seqlens.shape[1], device=cu_seqlens.device)
        shift = torch.arange(cu_seqlens.shape[0], device=cu_seqlens.device, dtype=cu_seqlens.dtype) * seq_length
        keep = (columns[None, :] >= 1) & (columns[None, :] <= last[:, None])  # (B, S + 1)
        out["cu_seqlens"] = torch.cat([cu_seqlens.new_zeros(1), (cu_seqlens + shift[:, None])[keep]])
        out["max_seqlen"] = fields["max_seqlen"].max()
        return out
    out["cu_seqlens"] = _packed_ends(np.asarray(cu_seqlens), seq_length).astype(np.int32)  # (D + 1,)
    out["max_seqlen"] = np.array(np.asarray(fields["max_seqlen"]).max(), dtype=np.int32)  # 0-d
    return out


def _packed_ends(cu_seqlens: np.ndarray, seq_length: int) -> np.ndarray:
    """(D + 1,) int64: the micro-batch's documents laid end to end (as :func:`pack_documents`).

    A row holds a few documents and then ``S`` repeated up to ``S + 1`` entries, so only each
    row's documents are visited (one compiled call where numba is installed; a micro-batch's dozen
    small numpy calls would cost more than the rest of the boundary fields together)."""
    cu_seqlens = np.ascontiguousarray(cu_seqlens)
    if numba_available():
        out = np.empty(cu_seqlens.shape[0] * (cu_seqlens.shape[1] - 1) + 1, dtype=np.int64)
        count = compiled(_packed_ends_kernel)(cu_seqlens, np.int64(seq_length), out)
        return out[:count]
    end = cu_seqlens.dtype.type(seq_length)
    last = np.array([np.searchsorted(row, end) for row in cu_seqlens], dtype=np.int64)  # (B,) first S of each row
    width = int(last.max()) if last.size else 0
    block = cu_seqlens[:, 1:width + 1].astype(np.int64)  # (B, width) the document ends, then S
    block += (np.arange(cu_seqlens.shape[0], dtype=np.int64) * seq_length)[:, None]
    keep = np.arange(width)[None, :] < last[:, None]  # (B, width)
    return np.concatenate([np.zeros(1, dtype=np.int64), block[keep]])


@jit(cache=True, nogil=True)
def _packed_ends_kernel(cu_seqlens, seq_length, out):
    """Write 0 and every row's document ends (up to its first ``seq_length``), shifted by
    ``row x seq_length``, into ``out``; returns how many entries it wrote."""
    out[0] = 0
    count = 1
    for r in range(cu_seqlens.shape[0]):
        for j in range(1, cu_seqlens.shape[1]):
            out[count] = np.int64(cu_seqlens[r, j]) + r * seq_length
            count += 1
            if cu_seqlens[r, j] == seq_length:
                break
    return count


def partition_indices(cu_seqlens_padded: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """Positions of the padded packed sequence that context-parallel rank ``cp_rank`` holds: of
    every document, chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` equal
    chunks, document after document (Transformer Engine's ``thd_get_partitioned_indices``).
    ``cu_seqlens_padded``: (D + 1,) ends of documents whose lengths are multiples of ``2 * cp_size``."""
    starts = np.asarray(cu_seqlens_padded[:-1], dtype=np.int64)  # (D,)
    chunk = np.diff(np.asarray(cu_seqlens_padded, dtype=np.int64)) // (2 * cp_size)  # (D,)
    firsts = np.stack([starts + cp_rank * chunk, starts + (2 * cp_size - 1 - cp_rank) * chunk], axis=1).reshape(-1)
    sizes = np.repeat(chunk, 2)  # (2D,)
    offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(firsts, sizes) + offsets  # (T / cp,)


# TODO(cp): checked against Transformer Engine's documented partitioning
# (thd_get_partitioned_indices), not against Transformer Engine itself, which needs a GPU build.
def partition_documents(fields: dict, seq_length: int, cp_size: int, cp_rank: int) -> dict:
    """Context-parallel rank ``cp_rank``'s share of a micro-batch in the packed THD form.

    The micro-batch's documents are laid end to end, each padded to a multiple of ``2 * cp_size``
    (a padding position gets token and label 0, loss mask 0, the document's id and the next
    position), and the rank keeps its two chunks of every document (:func:`partition_indices`).
    Returns the per-token fields (:data:`SEQUENCE_FIELDS` present in ``fields``) as ``(1, T / cp)``,
    ``T`` the padded length; ``cu_seqlens`` (D + 1,) int32 of the real lengths and
    ``cu_seqlens_padded`` (D + 1,) int32 of the padded ones, as Transformer Engine takes them with
    context parallelism; ``max_seqlen`` the longest padded document (0-d int32); ``document_ids``
    numbered from 1 over the micro-batch. Other fields are unchanged.
    """
    cu_seqlens = fields["cu_seqlens"]  # (B, S + 1)
    on_torch = hasattr(cu_seqlens, "index_select")
    host = cu_seqlens.cpu().numpy() if on_torch else np.asarray(cu_seqlens)
    ends = _packed_ends(host, seq_length)  # (D + 1,)
    lengths = np.diff(ends)  # (D,)
    unit = 2 * cp_size
    padded = -(-lengths // unit) * unit  # (D,)
    ends_padded = np.concatenate([[0], np.cumsum(padded)])  # (D + 1,)
    mine = partition_indices(ends_padded, cp_size, cp_rank)  # (T / cp,) positions of the padded sequence
    document = np.searchsorted(ends_padded, mine, side="right") - 1  # (T / cp,)
    offset = mine - ends_padded[document]  # (T / cp,) position inside its document
    real = offset < lengths[document]
    source = np.where(real, ends[document] + offset, 0)  # (T / cp,) index into the flattened (B * S) fields
    out = dict(fields)
    computed = {"position_ids": offset, "document_ids": document + 1}
    for name, fill in SEQUENCE_FIELDS.items():
        if name not in fields:
            continue
        value = fields[name]
        if fill is None:  # made here: the offset / the document, padding included
            made = computed[name].astype(np.int32 if name == "document_ids" else np.int64)
            out[name] = _like(value, made[None, :], on_torch)
            continue
        flat = value.reshape(-1)
        if on_torch:
            import torch

            picked = flat.index_select(0, torch.as_tensor(source, device=flat.device))
            picked = torch.where(torch.as_tensor(real, device=flat.device), picked, torch.zeros_like(picked))
        else:
            picked = np.where(real, flat[source], np.zeros((), dtype=flat.dtype))
        out[name] = picked.reshape(1, -1)
    out["cu_seqlens"] = _like(cu_seqlens, ends.astype(np.int32), on_torch)
    out["cu_seqlens_padded"] = _like(cu_seqlens, ends_padded.astype(np.int32), on_torch)
    out["max_seqlen"] = _like(cu_seqlens, np.array(padded.max() if padded.size else 0, dtype=np.int32), on_torch)
    return out


def _like(reference, array: np.ndarray, on_torch: bool):
    """``array`` as ``reference``'s kind: a numpy array, or a torch tensor on its device."""
    if not on_torch:
        return array
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(reference.device)


__all__ = ["SEQUENCE_FIELDS", "pack_documents", "partition_documents", "partition_indices"]
