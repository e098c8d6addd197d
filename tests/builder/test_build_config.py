"""BuildConfig: Megatron's vocabulary in, errors naming the field and value, canonical keys."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.builder import BuildConfig, load_build_config
from tokenloom.builder.config import build_config_from_dict
from tokenloom.errors import ConfigError
from tokenloom.index.blend_spec import BlendSpec
from tokenloom.source.keys import canonical_json, hash_key


def test_megatron_data_path_list_parses_weights_and_prefixes():
    config = BuildConfig(blend=["30", "a", "70", "b"], split="99,1,0", seq_length=8, train_samples=10,
                         valid_samples=1, test_samples=0)
    assert config.blend == BlendSpec(prefixes=("a", "b"), weights=(30.0, 70.0))
    unweighted = BuildConfig(blend=["a", "b"], split="1", seq_length=8)
    assert unweighted.blend == BlendSpec(prefixes=("a", "b"), weights=None)


def test_iterations_give_megatron_lm_sample_counts(tmp_path):
    path = tmp_path / "build.yaml"
    path.write_text("blend: [a]\nsplit: '969,30,1'\nseq_length: 2048\ntrain_iters: 1000\n"
                    "global_batch_size: 8\neval_interval: 100\neval_iters: 5\ncache: /tmp/c\n")
    config = load_build_config(path)
    assert config.samples_per_split == (8000, (1000 // 100 + 1) * 5 * 8, 5 * 8)
    assert config.cache_dir == "/tmp/c"


def test_json_and_per_split_blends(tmp_path):
    path = tmp_path / "build.json"
    path.write_text(json.dumps({
        "blend_per_split": {"train": ["1", "a", "3", "b"], "valid": ["c"]},
        "seq_length": 16, "samples": [100, 10, None]}))
    config = load_build_config(path, mode="exact")
    assert config.blend_for_split(2) is None
    # the file's relative stores name files beside it; the build key keeps the spelling
    assert config.prefixes == tuple(str(tmp_path / name) for name in "abc")
    assert config.blend_for_split(0).spelt() == ("a", "b") and config.spelling(str(tmp_path / "c")) == "c"
    assert config.samples_per_split == (100, 10, None)


def test_geometry_file_gives_samples_and_seq_length(tmp_path):
    from tokenloom.planning.data_geometry import DataGeometry

    DataGeometry(seq_length=512, global_batch_size=16, micro_batch_size=2, data_parallel_size=8,
                 gradient_accumulation_steps=1, train_iters=50, eval_interval=25,
                 eval_iters=2).write_json(tmp_path / "geometry.json")
    (tmp_path / "build.yaml").write_text("blend: [a]\nsplit: '98,1,1'\ngeometry: geometry.json\n")
    config = load_build_config(tmp_path / "build.yaml")
    assert config.seq_length == 512
    assert config.samples_per_split == (800, 3 * 2 * 16, 2 * 16)


@pytest.mark.parametrize("changes, field", [
    ({"seq_length": 0}, "seq_length"),
    ({"split": None}, "split"),
    ({"split": "1,-2"}, "split"),
    ({"seed": -1}, "seed"),
    ({"mode": "fast"}, "mode"),
    ({"blend": ["1", "a", "x", "b"]}, "blend"),
    ({"blend": {"prefixes": ["a", "b"], "weights": [1.0]}}, "weights"),
    ({"blend": {"prefixes": ["a"], "weights": [0.0]}}, "weight"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"train_samples": 1.5}, "train_samples"),
    ({"megatron_cache_dir": "/m", "mode": "stateless"}, "megatron_cache_dir"),
])
def test_bad_values_name_the_field_and_value(changes, field):
    values = {"blend": ["a", "b"], "split": "99,1,0", "seq_length": 8}
    values.update(changes)
    with pytest.raises(ConfigError, match=field):
        BuildConfig(**values)


def test_weighted_blend_needs_sample_counts():
    with pytest.raises(ConfigError, match="train_samples"):
        BuildConfig(blend=["1", "a", "2", "b"], split="1", seq_length=8)


def test_unknown_key_in_a_file_is_named(tmp_path):
    (tmp_path / "b.yaml").write_text("blend: [a]\nsplit: '1'\nseq_length: 8\nseq_len: 9\n")
    with pytest.raises(ConfigError, match="seq_len"):
        load_build_config(tmp_path / "b.yaml")


def test_blend_and_blend_per_split_are_exclusive():
    with pytest.raises(ConfigError, match="exactly one"):
        build_config_from_dict({"seq_length": 8, "split": "1", "blend": ["a"],
                                "blend_per_split": [["a"], None, None]})


@settings(max_examples=60, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12))
def test_canonical_json_round_trips_and_ignores_key_order(value):
    text = canonical_json(value)
    assert canonical_json(json.loads(text)) == text
    if isinstance(value, dict):
        assert canonical_json(dict(reversed(list(value.items())))) == text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=5))
       | st.lists(st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False))
       | st.lists(st.booleans() | st.integers(-3, 3) | st.none(), max_size=5))
def test_flat_lists_key_as_their_elements_do(value):
    # long lists of prefixes or weights skip the element-wise walk: the text must be the same
    assert canonical_json(value) == "[" + ",".join(canonical_json(v) for v in value) + "]"
    assert canonical_json(tuple(value)) == canonical_json(value)


def test_non_finite_numbers_in_a_list_are_refused():
    with pytest.raises(ConfigError, match="non-finite"):
        canonical_json([1.0, float("inf")])


def test_keys_change_with_every_array_field():
    from tokenloom.builder.config import ARRAY_FIELDS, array_config

    base = BuildConfig(blend=["1", "a", "3", "b"], split="99,1,0", seq_length=8, train_samples=10,
                       valid_samples=2, test_samples=1)
    changed = {
        "seq_length": 9, "blend": ["1", "a", "4", "b"], "split": "98,2,0", "train_samples": 11,
        "valid_samples": 3, "test_samples": 2, "seed": 1, "add_extra_token": False,
        "drop_last_partial_validation_sequence": False, "mid_level_dataset_surplus": 0.01,
        "mode": "stateless", "packing": "best_fit",
    }
    # blend_per_split and phases replace blend (test_build_schedule_config.py keys phases);
    # headroom needs phases (test_build_schedule_serving.py keys it)
    assert set(changed) | {"blend_per_split", "best_fit_window", "phases", "headroom"} == set(ARRAY_FIELDS)
    keys = {hash_key(array_config(base))}
    for name, value in changed.items():
        config = base.replace(**{name: value})
        keys.add(hash_key(array_config(config)))
    keys.add(hash_key(array_config(base.replace(packing="best_fit", best_fit_window=100))))
    assert len(keys) == len(changed) + 2


def test_array_config_of_a_concat_build_is_what_it_was_before_best_fit():
    # a build key names the build in a checkpoint's serving state: adding the packing fields must
    # not change the key of a build that does not use them
    from tokenloom.builder.config import array_config

    config = BuildConfig(blend=["a"], split="99,1,0", seq_length=8, train_samples=10)
    assert "packing" not in array_config(config) and "best_fit_window" not in array_config(config)
    assert array_config(config.replace(packing="best_fit"))["packing"] == "best_fit"
