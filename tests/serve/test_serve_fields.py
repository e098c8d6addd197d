"""build_fields (vectorised) against the per-row loop written as megatron-core writes it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.serve.samples import SampleOptions, _reference_fields, build_fields

options = st.builds(SampleOptions, eod_mask_loss=st.booleans(), reset_position_ids=st.booleans(),
                    reset_attention_mask=st.booleans(), create_attention_mask=st.booleans())


@settings(max_examples=150, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), width=st.integers(2, 24), extra=st.booleans(),
       options=options, pad_id=st.sampled_from([-1, 0, 3]))
def test_build_fields_matches_reference(data, batch, width, extra, options, pad_id):
    # small alphabet so EOD, pad and repeated ids are frequent
    rows = np.array(data.draw(st.lists(st.lists(st.integers(-1, 5), min_size=width, max_size=width),
                                       min_size=batch, max_size=batch)), dtype=np.int64)
    eods = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=batch, max_size=batch))
    got = build_fields(rows, eod_ids=np.array([-1 if e is None else e for e in eods]), pad_id=pad_id,
                       add_extra_token=extra, options=options)
    assert set(got) == set(options.field_names)
    for b in range(batch):
        want = _reference_fields(rows[b], eod_id=eods[b], pad_id=pad_id, add_extra_token=extra, options=options)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name][b], value, err_msg=name)
            assert got[name][b].dtype == value.dtype, name


def test_worked_example_resets_after_eod():
    # EOD = 9: positions restart after it, its own loss is masked, attention stops at it
    rows = np.array([[5, 6, 9, 7, 8, 9, 4]])
    fields = build_fields(rows, eod_ids=9, pad_id=-1, options=SampleOptions(
        eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True, create_attention_mask=True))
    np.testing.assert_array_equal(fields["tokens"], [[5, 6, 9, 7, 8, 9]])
    np.testing.assert_array_equal(fields["labels"], [[6, 9, 7, 8, 9, 4]])
    np.testing.assert_array_equal(fields["position_ids"], [[0, 1, 2, 0, 1, 2]])
    np.testing.assert_array_equal(fields["loss_mask"], [[1, 1, 0, 1, 1, 0]])
    # query 3 (token 7) sees keys 3 only; query 2 (the EOD) sees 0..2
    np.testing.assert_array_equal(~fields["attention_mask"][0, 0, 3], [0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(~fields["attention_mask"][0, 0, 2], [1, 1, 1, 0, 0, 0])


def test_padding_is_masked_and_zeroed():
    rows = np.array([[5, 6, -1, -1]])
    fields = build_fields(rows, eod_ids=None, pad_id=-1)
    np.testing.assert_array_equal(fields["tokens"], [[5, 6, 0]])
    np.testing.assert_array_equal(fields["labels"], [[6, 0, 0]])
    np.testing.assert_array_equal(fields["loss_mask"], [[1, 0, 0]])


def test_options_are_checked():
    with pytest.raises(ConfigError, match="eod_mask_loss=1"):
        SampleOptions(eod_mask_loss=1)
    with pytest.raises(ConfigError, match="shape"):
        build_fields(np.zeros(4), eod_ids=None, pad_id=-1)
