"""Shared sample semantics: how many epochs a packed-sample request needs, and how many samples
each epoch holds.

A *sample* is a window of ``seq_length`` tokens (plus ``add_extra_token`` more, so the labels can
be the inputs shifted by one) cut from the concatenation of documents, across document
boundaries. Consecutive samples share their boundary token when ``add_extra_token`` is set: sample
``k`` covers global token positions ``[k * seq_length, (k + 1) * seq_length + add_extra_token)``.

:func:`plan_epochs` reproduces megatron-core 0.19.2's ``GPTDataset`` arithmetic exactly (the epoch
count, the 0.80 rule that shuffles a short final epoch apart from the others, the
``num_samples=None`` meaning "one epoch"), in Python integers so nothing overflows. Both the
Megatron-exact index (:mod:`tokenloom.index.megatron_gpt`) and the stateless index build on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.validate import check_int

FINAL_EPOCH_THRESHOLD = 0.80
"""A final epoch contributing fewer than ``int(0.80 * num_samples_per_epoch)`` samples is
shuffled apart from the earlier epochs (megatron-core's ``separate_final_epoch``)."""


@dataclass(frozen=True, kw_only=True)
class EpochPlan:
    """How a packed-sample request maps onto epochs of one dataset split."""

    seq_length: int
    """Tokens per sample, not counting the extra label token."""

    add_extra_token: bool
    """Whether each sample carries one more token (shared with the next sample) for the labels."""

    num_samples_requested: int | None
    """Samples asked for; ``None`` means "as many as one epoch holds"."""

    num_documents: int
    """Documents in one epoch (the split's document ids)."""

    num_tokens_per_epoch: int
    """Tokens in one epoch: the sum of the split's document lengths."""

    num_epochs: int
    """Epochs the document index covers: the fewest whose tokens hold the requested samples."""

    num_samples_per_epoch: int
    """Whole samples one epoch holds: ``(num_tokens_per_epoch - extra) // seq_length``."""

    num_samples_sans_final_epoch: int
    """Whole samples the first ``num_epochs - 1`` epochs hold (0 when there is one epoch)."""

    num_samples_from_final_epoch: int
    """Requested samples that must come from the final epoch (with one epoch: all requested, or
    ``num_samples_per_epoch`` when ``num_samples_requested`` is None)."""

    separate_final_epoch: bool
    """Whether the final epoch is shuffled apart (documents and samples) from the earlier ones."""

    drop_last_partial: bool
    """Whether a trailing partial sample is dropped (False only on Megatron's validation path)."""

    num_samples_in_index: int
    """Rows of the sample index minus one: the samples actually built, always covering every
    epoch's tokens (at least ``num_samples_requested``). With ``drop_last_partial=False`` this is
    Megatron's float32 ``ceil``, see :func:`num_samples_in_index`."""

    @property
    def num_tokens_total(self) -> int:
        """Tokens in all epochs of the document index."""
        return self.num_epochs * self.num_tokens_per_epoch

    @property
    def sample_num_tokens(self) -> int:
        """Tokens each sample returns: ``seq_length + add_extra_token``."""
        return self.seq_length + int(self.add_extra_token)


def count_tokens_per_epoch(sequence_lengths: np.ndarray, document_ids: np.ndarray) -> int:
    """Sum of ``sequence_lengths[document_ids]`` as an exact Python int."""
    # gathered: (num_documents,) int32 -> summed in int64
    return int(np.sum(sequence_lengths[document_ids], dtype=np.int64))


def num_epochs_for(num_samples: int | None, *, num_tokens_per_epoch: int, seq_length: int,
                   add_extra_token: bool) -> int:
    """The fewest epochs whose tokens reach ``num_samples * seq_length + extra`` (1 for None)."""
    if num_samples is None:
        return 1
    num_tokens_requested = num_samples * seq_length + int(add_extra_token)
    return max(1, -(-num_tokens_requested // num_tokens_per_epoch))


def num_samples_in_index(num_tokens_total: int, *, seq_length: int, add_extra_token: bool,
                         drop_last_partial: bool) -> int:
    """Samples megatron-core's ``build_sample_idx`` makes from ``num_tokens_total`` tokens.

    Dropping the last partial sample: ``(num_tokens_total - extra) // seq_length``, with C++'s
    division truncating toward zero. Keeping it: ``ceil`` of the quotient computed in **float32**
    (megatron-core casts to ``float``), so for counts above 2**24 the result may differ from the
    exact ceiling by a few samples; this quirk is reproduced on purpose.
    """
    numerator = num_tokens_total - int(add_extra_token)
    if drop_last_partial:
        quotient = abs(numerator) // seq_length
        return quotient if numerator >= 0 else -quotient
    # One rounding int64 -> float32 (as C++ does), then a float32 division.
    quotient32 = np.array(numerator, dtype=np.int64).astype(np.float32) / np.array(
        seq_length, dtype=np.int32
    ).astype(np.float32)
    return math.ceil(float(quotient32))


def plan_epochs(sequence_lengths: np.ndarray, document_ids: np.ndarray, *,
                num_samples: int | None, seq_length: int, add_extra_token: bool = True,
                drop_last_partial: bool = True) -> EpochPlan:
    """Plan the epochs of one dataset split exactly as megatron-core 0.19.2's ``GPTDataset`` does.

    ``sequence_lengths`` are the lengths of every document in the token store; ``document_ids``
    the documents of this split (one epoch). Raises ConfigError where megatron-core would hang
    (samples requested from an epoch with no tokens) or fail an assertion. An epoch with no
    tokens and ``num_samples=None`` gives an empty index, as in megatron-core.
    """
    seq_length = check_int("seq_length", seq_length, minimum=1, expected="a positive integer number of tokens")
    if num_samples is not None:
        num_samples = check_int("num_samples", num_samples, minimum=0,
                                expected="a non-negative integer, or None for one epoch")
    extra = int(bool(add_extra_token))
    num_documents = int(np.shape(document_ids)[0])
    num_tokens_per_epoch = count_tokens_per_epoch(sequence_lengths, document_ids)
    if num_tokens_per_epoch == 0:
        # megatron-core builds an empty index for one epoch of nothing, and loops forever
        # looking for epochs that would hold any requested token.
        if num_samples is not None and num_samples * seq_length + extra > 0:
            raise ConfigError(
                f"num_samples={num_samples} from a split whose {num_documents} documents hold no "
                "tokens; expected a split with tokens (megatron-core would loop forever here); "
                "check the split string and that the token store is not empty"
            )
        num_epochs = 1
    else:
        num_epochs = num_epochs_for(num_samples, num_tokens_per_epoch=num_tokens_per_epoch,
                                    seq_length=seq_length, add_extra_token=add_extra_token)
    num_samples_per_epoch = max(0, (num_tokens_per_epoch - extra) // seq_length)
    if num_epochs == 1:
        separate_final_epoch = False
        num_samples_sans_final_epoch = 0
        num_samples_from_final_epoch = num_samples_per_epoch if num_samples is None else num_samples
    else:
        assert num_samples is not None  # num_epochs > 1 only for a requested count
        num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - extra) // seq_length
        num_samples_from_final_epoch = num_samples - num_samples_sans_final_epoch
        if not 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1:
            raise ConfigError(
                f"num_samples={num_samples} needs {num_samples_from_final_epoch} samples from the "
                f"final epoch, outside [0, {num_samples_per_epoch + 1}] (megatron-core asserts "
                "here); use a seq_length much smaller than an epoch's tokens"
            )
        # Python float product then truncation, exactly as megatron-core writes it.
        separate_final_epoch = num_samples_from_final_epoch < int(
            FINAL_EPOCH_THRESHOLD * num_samples_per_epoch
        )
    return EpochPlan(
        seq_length=seq_length,
        add_extra_token=bool(add_extra_token),
        num_samples_requested=num_samples,
        num_documents=num_documents,
        num_tokens_per_epoch=num_tokens_per_epoch,
        num_epochs=num_epochs,
        num_samples_per_epoch=num_samples_per_epoch,
        num_samples_sans_final_epoch=num_samples_sans_final_epoch,
        num_samples_from_final_epoch=num_samples_from_final_epoch,
        separate_final_epoch=separate_final_epoch,
        drop_last_partial=bool(drop_last_partial),
        num_samples_in_index=num_samples_in_index(
            num_epochs * num_tokens_per_epoch, seq_length=seq_length,
            add_extra_token=add_extra_token, drop_last_partial=drop_last_partial,
        ),
    )


def plan_run_epochs(num_tokens_per_epoch: int, num_documents: int, *, first_token: int, num_samples: int,
                    seq_length: int, add_extra_token: bool = True) -> EpochPlan:
    """The epochs of a *length run* (:mod:`tokenloom.index.length_runs`): ``num_samples`` samples
    cut by concatenation from a dataset's document stream from stream token ``first_token`` on,
    sample ``k`` holding tokens ``[first_token + k * seq_length, first_token + (k + 1) * seq_length
    + extra)``. Not a megatron-core request, so none of :func:`plan_epochs`' rounding applies:

    * ``num_samples_in_index`` is ``num_samples`` exactly (the tokens after the run's last sample
      are the next run's, not more samples of this one);
    * ``num_epochs`` is the fewest whose tokens reach ``first_token + num_samples * seq_length +
      extra``, the last sample's last token (at least 1); epochs before the one holding
      ``first_token`` are counted too, so positions stay global (``epoch * num_documents + p``);
    * a run's samples are shuffled as one part: ``separate_final_epoch`` is False,
      ``num_samples_sans_final_epoch`` 0 and ``num_samples_from_final_epoch`` all of them, as in
      a one-epoch plan.

    ``drop_last_partial`` is True: every sample of a run is whole.
    """
    first_token = check_int("first_token", first_token, minimum=0, maximum=(1 << 63) - 1,
                            expected="a stream token in [0, 2**63): where the run's first sample starts")
    seq_length = check_int("seq_length", seq_length, minimum=1, expected="a positive integer number of tokens")
    num_samples = check_int("num_samples", num_samples, minimum=0,
                            expected="a non-negative integer: a length run holds exactly the samples asked for")
    num_tokens_per_epoch = check_int("num_tokens_per_epoch", num_tokens_per_epoch, minimum=1,
                                     expected="a positive integer (a stream of no tokens holds no run)")
    extra = int(bool(add_extra_token))
    reach = first_token + num_samples * seq_length + extra  # tokens of the stream the last sample reads
    return EpochPlan(
        seq_length=seq_length,
        add_extra_token=bool(add_extra_token),
        num_samples_requested=num_samples,
        num_documents=int(num_documents),
        num_tokens_per_epoch=num_tokens_per_epoch,
        num_epochs=max(1, -(-reach // num_tokens_per_epoch)),
        num_samples_per_epoch=max(0, (num_tokens_per_epoch - extra) // seq_length),
        num_samples_sans_final_epoch=0,
        num_samples_from_final_epoch=num_samples,
        separate_final_epoch=False,
        drop_last_partial=True,
        num_samples_in_index=num_samples,
    )


__all__ = [
    "FINAL_EPOCH_THRESHOLD",
    "EpochPlan",
    "count_tokens_per_epoch",
    "num_epochs_for",
    "num_samples_in_index",
    "plan_epochs",
    "plan_run_epochs",
]
