"""The streamed JSON writer (manifests): the same bytes as the one-shot form, and atomic."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.io.writer import compact_json, write_json_arrays_atomic, write_json_atomic

scalars = st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False) | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
fields = st.dictionaries(st.text(max_size=8), values, max_size=6)


@settings(max_examples=150, deadline=None)
@given(payload=fields, arrays=st.dictionaries(st.text(max_size=8), st.lists(values, max_size=5), max_size=3))
def test_streamed_arrays_are_byte_identical_to_one_shot(tmp_path_factory, payload, arrays):
    arrays = {name: elements for name, elements in arrays.items() if name not in payload}
    directory = tmp_path_factory.mktemp("json")
    one_shot, streamed = str(directory / "one.json"), str(directory / "streamed.json")
    write_json_atomic(one_shot, {**payload, **arrays}, compact=True)
    # elements handed over one at a time, as compact texts, by a generator
    write_json_arrays_atomic(streamed, payload, {name: (compact_json(e) for e in elements)
                                                 for name, elements in arrays.items()})
    with open(one_shot, "rb") as a, open(streamed, "rb") as b:
        assert a.read() == b.read()
    with open(streamed) as f:
        assert json.load(f) == json.loads(compact_json({**payload, **arrays}))


def test_a_failing_element_source_leaves_the_old_file_and_no_temp(tmp_path):
    path = str(tmp_path / "manifest.json")
    write_json_atomic(path, {"old": True}, compact=True)

    def elements():
        yield compact_json({"a": 1})
        raise OSError("the pack index vanished")

    with pytest.raises(OSError, match="vanished"):
        write_json_arrays_atomic(path, {"format": "x"}, {"items": elements()})
    with open(path) as f:
        assert json.load(f) == {"old": True}
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_a_field_given_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"fields \['items'\] given both"):
        write_json_arrays_atomic(str(tmp_path / "m.json"), {"items": []}, {"items": iter(())})
    assert os.listdir(tmp_path) == []
