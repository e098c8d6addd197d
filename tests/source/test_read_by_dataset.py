"""read_by_dataset: rows are gathered per dataset into their own places; bad ids are refused."""

import numpy as np
import pytest

from tokenloom.errors import ConfigError
from tokenloom.source import DatasetInfo
from tokenloom.source.blended import read_by_dataset

DATASETS = (DatasetInfo(name="web", weight=0.75, num_samples=10, eod_id=0),
            DatasetInfo(name="code", weight=0.25, num_samples=3, eod_id=0))


def _fill(calls):
    def fill(d, rows, wanted, out):
        calls.append(d)
        out[rows] = (1000 * d + wanted)[:, None]  # each row holds its own (dataset, sample) code
    return fill


def test_rows_keep_their_places_and_each_dataset_is_read_once():
    calls = []
    dataset_ids = np.array([1, 0, 1, 0, 0])
    sample_ids = np.array([2, 9, 0, 4, 4])
    out = read_by_dataset(dataset_ids, sample_ids, datasets=DATASETS, width=3, fill=_fill(calls))
    assert out.shape == (5, 3) and out.dtype == np.int64
    np.testing.assert_array_equal(out[:, 0], 1000 * dataset_ids + sample_ids)
    assert sorted(calls) == [0, 1]


@pytest.mark.parametrize(
    "dataset_ids, sample_ids, message",
    [
        ([2], [0], r"dataset id 2; the blend has 2 datasets"),
        ([-1], [0], r"dataset id -1; the blend has 2 datasets"),
        ([0, 1], [1, 3], r"dataset 1 \(code\) asked for sample 3 but its index holds 3"),
        ([0], [-5], r"dataset 0 \(web\) asked for sample -5 but its index holds 10"),
    ],
)
def test_bad_ids_name_the_dataset_and_the_sample(dataset_ids, sample_ids, message):
    calls = []
    with pytest.raises(ConfigError, match=message):
        read_by_dataset(np.array(dataset_ids), np.array(sample_ids), datasets=DATASETS, width=2, fill=_fill(calls))


@pytest.mark.parametrize("source", ["StoreBlendSource", "StatelessBlendSource"])
@pytest.mark.parametrize(
    "prefixes, weights, split_name, message",
    [
        ([], None, "train", "prefixes is empty"),
        (["a", "b"], [1.0], "train", "1 weights for 2 prefixes"),
        (["a", "b"], [1.0, float("nan")], "train", r"weights=\[1.0, nan\]; expected finite positive numbers"),
        (["a"], [0.0], "train", "expected finite positive numbers"),
        (["a"], None, "dev", r"split_name='dev'; expected one of \('train', 'valid', 'test'\)"),
    ],
)
def test_both_sources_refuse_bad_blend_arguments_before_opening_anything(source, prefixes, weights,
                                                                         split_name, message):
    import tokenloom.source

    cls = getattr(tokenloom.source, source)
    with pytest.raises(ConfigError, match=message):
        cls.from_prefixes(prefixes, weights, num_samples=8, seq_length=4, split_name=split_name)
