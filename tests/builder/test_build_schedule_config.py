"""A build config's ``phases`` (issue 40, step 3): read like ``blend``, the union of the phases'
stores, one phase equal to today's config key for key, several planned and shown by the dry run,
refused by a real build before anything is written."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest
import yaml

from build_fixtures import make_stores
from tokenloom.builder.config import ARRAY_FIELDS, BuildConfig, array_config, build_config_from_dict, load_build_config
from tokenloom.builder.items import ranges_for, resolve_items
from tokenloom.builder.packs import CACHE_FORMAT_VERSION
from tokenloom.builder.stores import StoreFingerprint, StoreInfo
from tokenloom.cli.builder import add_build_parser
from tokenloom.errors import ConfigError
from tokenloom.index.batch_sizes import parse_step_schedule, rampup_steps
from tokenloom.index.blend import largest_remainder_counts
from tokenloom.index.split import split_document_ranges
from tokenloom.io import IndexedDataset
from tokenloom.serve.geometry import BatchSizeSchedule
from tokenloom.source.keys import build_key, hash_key

#: The issue's three phases, on toy numbers (seq_length 64, 16 samples a step).
THREE = [
    {"blend": ["3", "stores/store0", "1", "stores/store1"], "until": {"samples": 100}},
    {"blend": ["1", "stores/store0", "1", "stores/store1"], "until": {"tokens": 12800}, "ramp": "linear"},
    {"blend": ["1", "stores/store1", "2", "stores/store2"], "until": {"steps": 20}},
]
BASE = {"split": "90,8,2", "seq_length": 64, "global_batch_size": 16, "valid_samples": 32, "test_samples": 16}


def schedule(phases=THREE, *, source="build.yaml", base_dir="/data/run", **changes) -> BuildConfig:
    """THREE's config with ``changes`` (None leaves a key out)."""
    values = {key: value for key, value in {**BASE, "phases": phases, **changes}.items() if value is not None}
    return build_config_from_dict(values, source=source, base_dir=base_dir)


# ------------------------------------------------------------------------------------ reading


def test_phases_read_from_a_dict_make_the_union_and_scatter_each_phases_weights():
    config = schedule()
    assert config.blend is None and config.train_samples is None and len(config.phases) == 3
    # the union in first-seen order: store2 enters in phase 3
    assert config.schedule_stores.spelt() == ("stores/store0", "stores/store1", "stores/store2")
    assert config.schedule_stores.prefixes == tuple(f"/data/run/stores/store{i}" for i in range(3))
    plan = config.schedule_plan()
    weights = [phase.weights for phase in plan.schedule.phases]
    assert weights == [(0.75, 0.25, 0.0), (0.5, 0.5, 0.0), (0.0, 1 / 3, 2 / 3)]  # zero where a phase names none
    # the kernel's exact counts, phase by phase: store2 serves only in phase 3, store0 stops after phase 2
    assert plan.boundaries == (0, 112, 208, 320)
    assert plan.counts[0].tolist() == largest_remainder_counts(np.array(weights[0]), 112).tolist() == [84, 28, 0]
    assert plan.counts[2].tolist() == largest_remainder_counts(np.array(weights[2]), 112).tolist() == [0, 37, 75]
    assert plan.counts.sum(axis=1).tolist() == [112, 96, 112]
    assert plan.totals.tolist() == plan.counts.sum(axis=0).tolist() == [144, 101, 75]
    # every split reads the served stores, weighted by the schedule's samples of each
    train = config.blend_for_split(0)
    assert train.spelt() == ("stores/store0", "stores/store1", "stores/store2")
    assert train.weights == (144.0, 101.0, 75.0)
    assert config.samples_per_split == (320, 32, 16) and config.num_train_steps == 20


def test_every_form_of_blend_reads_in_a_phase():
    forms = [["3", "stores/store0", "1", "stores/store1"], "3 stores/store0 1 stores/store1",
             {"prefixes": ["stores/store0", "stores/store1"], "weights": [3, 1]},
             [["stores/store0", "stores/store1"], [3, 1]]]
    plans = [schedule([{"blend": form, "until": {"samples": 96}}, *THREE[1:]]).schedule_plan() for form in forms]
    assert all(np.array_equal(p.counts, plans[0].counts) for p in plans)
    # a lone store needs no weight
    lone = schedule([{"blend": ["stores/store0"], "until": {"samples": 96}}, THREE[2]]).schedule_plan()
    assert lone.counts.tolist() == [[96, 0, 0], [0, 75, 149]]


def test_phases_read_from_a_yaml_file_name_stores_beside_it(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    phases = [dict(THREE[0], until={"tokens": 7000.0}), *THREE[1:]]  # a float of whole tokens
    (folder / "build.yaml").write_text(yaml.safe_dump({**BASE, "phases": phases, "max_epochs": {"stores/store2": 3}}))
    (folder / "raw.yaml").write_text(
        "split: '90,8,2'\nseq_length: 64\nglobal_batch_size: 16\nsamples: [null, 32, 16]\nphases:\n"
        "  - {blend: ['3', stores/store0, '1', stores/store1], until: {tokens: 7e3}}\n"
        "  - {blend: [stores/store2], until: {samples: 200}}\n")
    config = load_build_config(folder / "build.yaml")
    assert config.schedule_stores.prefixes == tuple(str(folder / "stores" / f"store{i}") for i in range(3))
    assert config.max_epochs == {str(folder / "stores" / "store2"): 3.0}
    assert config.schedule_plan().requested[0] == 110  # ceil(7000 / 64)
    # the key holds the stores as spelt, so the folder can move
    assert array_config(config)["phases"]["phases"][0]["blend"]["prefixes"] == ["stores/store0", "stores/store1"]
    moved = load_build_config(folder / "build.yaml").replace(base_dir=str(tmp_path / "elsewhere"))
    assert hash_key(array_config(moved)) == hash_key(array_config(config))
    raw = load_build_config(folder / "raw.yaml")  # 7e3 is a string to YAML: still a number of tokens
    assert raw.schedule_plan().requested == (110, 200) and raw.samples_per_split == (200, 32, 16)


def test_a_config_with_phases_survives_replace_and_keys_what_places_its_phases():
    config = schedule()
    again = config.replace(mode="stateless")
    assert again.schedule_stores == config.schedule_stores and again.phases == config.phases
    assert np.array_equal(again.schedule_plan().counts, config.schedule_plan().counts)
    keys = {hash_key(array_config(c)) for c in (
        config, again, schedule(global_batch_size=32), schedule(rampup_batch_size=[8, 8, 64]),
        schedule([*THREE[:2], dict(THREE[2], until={"steps": 21})]),
        schedule([THREE[0], dict(THREE[1], ramp=None), THREE[2]]))}
    assert len(keys) == 6
    assert "phases" in ARRAY_FIELDS and array_config(config)["phases"]["batch_size_steps"] == [[0, 16]]


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("phases, changes, message", [
    ([THREE[0], dict(THREE[1], until={"samples": 90})], {},
     r"build.yaml: phase 2: until \{samples: 90\} does not move forward from phase 1's until \{samples: 100\}"),
    ([dict(THREE[0], until={"steps": 10}), dict(THREE[1], until={"samples": 150})], {},
     r"build.yaml: phase 2: until \{samples: 150\} is not past phase 1's end at sample 160"),
    ([THREE[0], dict(THREE[1], blend={"prefixes": ["a", "b"], "weights": [1.0]})], {},
     r"build.yaml: phase 2: blend: 2 prefixes but weights=\[1.0\]; expected one weight per prefix"),
    ([THREE[0], dict(THREE[1], blend=["0.5", "a", "0.5"])], {}, r"build.yaml: phase 2: blend=.* mixes numbers"),
    ([dict(THREE[0], ramp="linear"), THREE[1]], {}, r"build.yaml: phase 1: ramp='linear'; the first phase has no"),
    ([THREE[0], dict(THREE[1], until={"samples": 120})], {},
     r"build.yaml: phase 2: until \{samples: 120\} leaves the phase 8 samples, fewer than the global batch of 16"),
    ([dict(THREE[0], until={"samples": 10}), THREE[1]], {}, r"phase 1: until \{samples: 10\} leaves the phase 10"),
    ([THREE[0], dict(THREE[1], until={"epochs": 2})], {}, r"build.yaml: phase 2: until: unknown kind 'epochs'"),
    ([THREE[0], dict(THREE[1], until={"tokens": 1.5})], {}, r"phase 2: until: tokens=1.5; expected a positive whole"),
    ([THREE[0], dict(THREE[1], ramp="cosine")], {}, r"build.yaml: phase 2: ramp: 'cosine'; expected 'linear'"),
    ([THREE[0], {"blend": ["a"]}], {}, r"build.yaml: phase 2: no until"),
    ([{"weights": [1], "until": {"samples": 16}}], {}, r"phase 1: unknown key 'weights'; a phase's blend carries"),
    ([{"blend": ["a"], "untill": {"samples": 16}}], {}, r"phase 1: unknown key 'untill'; did you mean 'until'\?"),
    ([THREE[0], dict(THREE[1], blend=["a", "b"])], {}, r"phase 2: blend: 2 stores without weights"),
    ([THREE[0], dict(THREE[1], blend={"prefixes": ["a"], "tokens": [6400]})], {},
     r"phase 2: blend: token and epoch budgets are not read in a phase"),
    ([THREE[0], dict(THREE[1], blend=["1", "a", "1", "a"])], {}, r"phase 2: blend: names store 'a' twice"),
    ([*THREE[:2], dict(THREE[2], seq_length=128)], {"packing": "best_fit"},
     r"build.yaml: phase 3: seq_length: 128 differs from the build's seq_length 64.* not yet with packing: best_fit"),
    ("stores/store0", {}, r"build.yaml: phases='stores/store0'; expected a list of phases"),
    (THREE, {"blend": ["a"]}, r"build.yaml: phases and blend both given"),
    (THREE, {"train_samples": 320}, r"build.yaml: phases and train_samples both given"),
    (THREE, {"train_iters": 20}, r"build.yaml: phases and train_iters both given"),
    (THREE, {"samples": [320, 32, 16]}, r"build.yaml: phases and samples\[0\]=320 \(train\) both given"),
    (THREE, {"global_batch_size": None}, r"build.yaml: phases without global_batch_size"),
    (THREE, {"split": None}, r"split is required with phases"),
    (THREE, {"rampup_batch_size": [8, 8, 64], "step_batch_size_schedule": "0:8 1K:16"},
     r"rampup_batch_size and step_batch_size_schedule both given"),
    (THREE, {"rampup_batch_size": [8, 8]}, r"rampup_batch_size=\[8, 8\]; expected Megatron-LM's"),
    (THREE, {"rampup_batch_size": [5, 2, 64]},
     r"rampup_batch_size=\[5, 2, 64\]: rampup from 5 to global_batch_size 16"),
    (THREE, {"step_batch_size_schedule": "0:8 1K:32"}, r"ends at batch size 32 but global_batch_size=16"),
    (THREE, {"max_epochs": 0}, r"max_epochs=0; expected a number of epochs > 0"),
    (THREE, {"max_epochs": {"stores/store3": 1}}, r"max_epochs: '/data/run/stores/store3' is not a store of the build; "
                                                  r"did you mean"),
    (THREE, {"max_epochs": {"stores/store2": "many"}}, r"max_epochs\[.*store2'\]='many'; expected a number"),
])
def test_bad_schedules_are_config_errors_naming_the_file_phase_and_key(phases, changes, message):
    values = {**BASE, "phases": phases, **changes}
    values = {k: v for k, v in values.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        build_config_from_dict(values, source="build.yaml", base_dir="/data/run")


def test_an_error_names_the_config_file(tmp_path):
    path = tmp_path / "build.yaml"
    # phase 2 asked for 12,800 tokens and ended at sample 208 (13,312 tokens): 13,000 lies behind it
    path.write_text(yaml.safe_dump({**BASE, "phases": [*THREE[:2], dict(THREE[2], until={"tokens": 13000})]}))
    with pytest.raises(ConfigError) as caught:
        load_build_config(path)
    assert str(caught.value) == (f"{path}: phase 3: until {{tokens: 13000}} (sample 208) is not past phase 2's end "
                                 "at sample 208; expected a later until")


# ------------------------------------------------------------------------------------ one phase = today


def fake_infos(config: BuildConfig) -> dict[str, StoreInfo]:
    """Fingerprints made up from the prefixes alone: item keys that depend on nothing on disk."""
    infos = {}
    for i, prefix in enumerate(config.prefixes):
        n = 1000 + 97 * i
        fingerprint = StoreFingerprint(idx_bytes=100 + i, bin_bytes=200_000 + i, idx_mtime_ns=1, bin_mtime_ns=2,
                                       idx_sha256=f"{i:064x}")
        ranges = ranges_for(config, prefix)(n)
        infos[prefix] = StoreInfo(prefix=prefix, fingerprint=fingerprint, num_sequences=n, num_tokens=n * 150,
                                  range_tokens=tuple((b, e, (e - b) * 150) for b, e in ranges))
    return infos


def keys_of(config: BuildConfig) -> tuple[str, list[str]]:
    """The build key (as the finalize phase makes it) and every item key, on made-up fingerprints."""
    items, splits = resolve_items(config, fake_infos(config))
    item_keys = sorted(item.key for item in items)
    return build_key({"format": CACHE_FORMAT_VERSION, "config": array_config(config), "items": item_keys,
                      "splits": [[s.name, list(s.dataset_keys), s.blend_key] for s in splits]}), item_keys


DEMO = {"split": "98,1,1", "seq_length": 512, "seed": 1234, "global_batch_size": 32, "eval_interval": 100,
        "eval_iters": 4, "cache": "cache", "timeout_s": 300}
DEMO_BLEND = ["0.5", "stores/code", "0.3", "stores/tests", "0.2", "stores/topics"]

#: hash_key(array_config(...)) and the build key on made-up fingerprints, taken before phases
#: existed: no existing key may move.
GOLDEN_ARRAY_CONFIG = {
    "demo": "45f2e7c369d866b9626f0731c77a575372229aac",
    "per_split": "50c6f4369f0782a76e9fee0b0e5628b99d2559fc",
    "stateless_best_fit": "adf508d3713b139234243e99c399ffaeab3cb29b",
    "tokens": "3d1903a3ef575daa30b6ebaee6afa45347c42266",
    "epochs": "f2f5b606c42e1e424d706f24358441a3889eaa8b",
}
GOLDEN_BUILD_KEYS = {
    ("demo", "exact"): "873512ec838cfd74263ee7473f9ce92beb91f5c2",
    ("demo", "stateless"): "8c599dd6fd29a450ce0405844e8f4b626290ece5",
    ("per_split", "exact"): "4cf5e4af00dbdd7296ce566e98d2cfc492a698a9",
    ("per_split", "stateless"): "53de56989dec85e86a8855eeabbf5a13fe06554a",
    ("tokens", "exact"): "8d75ad5e86accb0824405024126a0e2f0fe716f1",
    ("tokens", "stateless"): "492a05ee18e05470840822a50f9df61526ce6c20",
}
GOLDEN_CONFIGS = {
    "demo": {**DEMO, "blend": DEMO_BLEND, "train_iters": 200},
    "per_split": {"blend_per_split": {"train": ["1", "a", "3", "b"], "valid": ["c"]}, "seq_length": 16,
                  "samples": [100, 10, None]},
    "stateless_best_fit": {"blend": {"prefixes": ["a", "b"], "weights": [3.0, 5.0]}, "split": "90,8,2",
                           "seq_length": 64, "train_samples": 3000, "valid_samples": 200, "test_samples": 60,
                           "mode": "stateless", "packing": "best_fit", "best_fit_window": 500},
    "tokens": {"blend": {"prefixes": ["a", "b"], "tokens": [6400, 12800]}, "split": "99,1,0", "seq_length": 64,
               "valid_samples": 5, "test_samples": 0},
    "epochs": {"blend": {"prefixes": ["a", "b"], "epochs": [1.5, 2]}, "split": "99,1,0", "seq_length": 64,
               "valid_samples": 5, "test_samples": 0},
}


def test_no_existing_key_moved():
    for name, golden in GOLDEN_ARRAY_CONFIG.items():
        config = build_config_from_dict(GOLDEN_CONFIGS[name], base_dir="/data/run")
        assert hash_key(array_config(config)) == golden, name
        assert "phases" not in array_config(config)
    for (name, mode), golden in GOLDEN_BUILD_KEYS.items():
        config = build_config_from_dict({**GOLDEN_CONFIGS[name], "mode": mode}, base_dir="/data/run")
        assert keys_of(config)[0] == golden, (name, mode)


@pytest.mark.parametrize("until", [{"steps": 200}, {"samples": 6400}, {"tokens": 6400 * 512 - 100}])
@pytest.mark.parametrize("changes", [{}, {"mode": "stateless"}, {"packing": "best_fit"},
                                     {"rampup_batch_size": [16, 8, 640]}])
def test_one_phase_is_todays_config_key_for_key(until, changes):
    # the phase's end in samples: 200 steps of 32, or under the ramp 20 steps of 16, 14 of 24, 166 of 32
    samples = 20 * 16 + 14 * 24 + 166 * 32 if "steps" in until and changes.get("rampup_batch_size") else 6400
    common = {key: value for key, value in DEMO.items() if key not in ("eval_interval", "eval_iters")}
    today = build_config_from_dict({**common, "blend": DEMO_BLEND, "train_samples": samples, "valid_samples": 384,
                                    "test_samples": 128, **changes}, base_dir="/data/run")
    one = build_config_from_dict({**common, "phases": [{"blend": DEMO_BLEND, "until": until}],
                                  "samples": [None, 384, 128], **changes}, base_dir="/data/run")
    assert one.phases is None and one.blend == today.blend and one.samples_per_split == today.samples_per_split
    assert array_config(one) == array_config(today)
    assert hash_key(array_config(one)) == hash_key(array_config(today))
    if not changes:
        assert hash_key(array_config(one)) == GOLDEN_ARRAY_CONFIG["demo"]
    if changes.get("packing") != "best_fit":  # a best-fit plan needs its packed chunks
        assert keys_of(one) == keys_of(today)
    assert one.replace(seed=7).blend == today.replace(seed=7).blend  # stays today's config when replaced


def test_one_phase_from_a_yaml_file_is_the_blend_config_beside_it(tmp_path):
    (tmp_path / "blend.yaml").write_text(yaml.safe_dump({**DEMO, "blend": DEMO_BLEND, "train_iters": 200}))
    (tmp_path / "phases.yaml").write_text(yaml.safe_dump({**DEMO, "phases": [
        {"blend": DEMO_BLEND, "until": {"tokens": 3.2768e6}}]}))
    today, one = load_build_config(tmp_path / "blend.yaml"), load_build_config(tmp_path / "phases.yaml")
    assert one.blend.prefixes == tuple(str(tmp_path / p) for p in DEMO_BLEND[1::2])
    assert array_config(one) == array_config(today) and keys_of(one) == keys_of(today)
    assert hash_key(array_config(one)) == GOLDEN_ARRAY_CONFIG["demo"]


# ------------------------------------------------------------------------------------ conversions


def test_steps_tokens_and_samples_convert_through_the_batch_sizes():
    # constant batch: steps x 16; tokens ceil(T / 64) then up to the step's end
    plan = schedule().schedule_plan()
    assert plan.requested == (100, 200, 320) and plan.boundaries == (0, 112, 208, 320)
    assert plan.boundary_steps == (0, 7, 13, 20)
    # a ramp 8 -> 16 over 64 samples: steps of 8 until sample 64 (Megatron-LM's classic formula)
    ramped = schedule(rampup_batch_size=[8, 8, 64]).schedule_plan()
    steps = rampup_steps(start=8, increment=8, ramp_samples=64, global_batch_size=16)
    assert schedule(rampup_batch_size=[8, 8, 64]).batch_size_steps == steps == ((0, 8), (64, 16))
    assert ramped.boundaries == (0, 112, 208, 64 + 16 * (20 - 8)) and ramped.boundary_steps == (0, 11, 17, 20)
    # Megatron-LM's step schedule, thresholds in tokens: 4096 tokens = 64 samples; it gives the batch size
    stepped = schedule(global_batch_size=None, step_batch_size_schedule="0:8 4096:16")
    assert stepped.global_batch_size == 16 and stepped.batch_size_steps == ((0, 8), (64, 16))
    assert stepped.schedule_plan().boundaries == ramped.boundaries
    assert stepped.batch_size_steps == parse_step_schedule("0:8 4096:16", seq_length=64) \
        == BatchSizeSchedule.parse("0:8 4096:16", seq_length=64).steps  # serving reads it by the same rule


def test_eval_interval_and_eval_iters_count_the_schedules_steps():
    config = schedule(valid_samples=None, test_samples=None, eval_interval=5, eval_iters=2)
    assert config.num_train_steps == 20
    assert config.samples_per_split == (320, (20 // 5 + 1) * 2 * 16, 2 * 16)
    with pytest.raises(ConfigError, match=r"valid_samples=7 disagrees with 160 from the schedule's 20 steps"):
        schedule(valid_samples=7, test_samples=None, eval_interval=5, eval_iters=2)
    # one phase ending at step 200 is today's train_iters: 200
    one = build_config_from_dict({**DEMO, "phases": [{"blend": DEMO_BLEND, "until": {"steps": 200}}]})
    today = build_config_from_dict({**DEMO, "blend": DEMO_BLEND, "train_iters": 200})
    assert one.samples_per_split == today.samples_per_split == (6400, 384, 128)


def test_max_epochs_caps_what_the_schedule_may_take_of_a_store():
    config = schedule(max_epochs={"stores/store1": 2.0})
    store1 = "/data/run/stores/store1"
    config.check_max_epochs({store1: 51})  # 101 samples over the schedule, 102 allowed
    with pytest.raises(ConfigError, match=r"dataset 1 \('stores/store1'\): the schedule needs 64 of its samples by "
                                          r"the end of phase 2 \(36 in that phase\), more than the 60 its max_epochs"):
        config.check_max_epochs({store1: 30})
    config.check_max_epochs({})  # no epoch known: nothing to check
    # a blend config: one phase, its largest-remainder counts
    blend = build_config_from_dict({**DEMO, "blend": DEMO_BLEND, "train_iters": 200, "max_epochs": 1.5},
                                   base_dir="/data/run")
    code = "/data/run/stores/code"
    blend.check_max_epochs({code: 2134})  # 3200 of 3201
    with pytest.raises(ConfigError, match=r"'stores/code'\): the schedule needs 3200 .* phase 1"):
        blend.check_max_epochs({code: 2133})


# ------------------------------------------------------------------------------------ the command line


def _run(argv) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom")
    add_build_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


@pytest.fixture()
def schedule_file(tmp_path):
    make_stores(tmp_path / "stores")
    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump({**BASE, "phases": THREE, "seed": 7}))
    return path


def _listing(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def test_dry_run_prints_the_schedule_and_writes_nothing(schedule_file, tmp_path, capsys):
    before = _listing(tmp_path)
    assert _run(["build", str(schedule_file), "--cache", str(tmp_path / "c"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # the plan's items, as for a blend; exact mode: the last phase at megatron-core's blended size (320 asked)
    assert "train: 321 samples from 3 store(s) (blended)" in out
    assert "schedule: 3 phases over 3 store(s): 320 samples, 20 steps, 20,480 tokens" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("      ")}
    # phase, until (asked), the sample it asked, where it ended, steps, samples, tokens, ramp
    assert rows["1"] == ["1", "{samples:", "100}", "100", "112", "7", "112", "7,168", "-"]
    assert rows["2"] == ["2", "{tokens:", "12800}", "200", "208", "13", "96", "6,144", "linear"]
    assert rows["3"] == ["3", "{steps:", "20}", "320", "320", "20", "112", "7,168", "-"]
    shares = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  stores/")}
    assert shares["stores/store0"][:7] == ["stores/store0", "0.7500", "(", "84)", "0.6250", "(", "60)"]
    assert shares["stores/store2"][1:4] == ["0.0000", "(", "0)"] and shares["stores/store2"][-2] == "75"
    train = split_document_ranges("90,8,2", 594).train  # store2's train documents
    lengths = IndexedDataset(str(tmp_path / "stores" / "store2")).sequence_lengths[train.begin:train.end]
    per_epoch = (int(np.asarray(lengths, dtype=np.int64).sum()) - 1) // 64
    assert float(shares["stores/store2"][-1]) == pytest.approx(75 / per_epoch, abs=2e-3)
    assert _listing(tmp_path) == before and not (tmp_path / "c").exists()


def test_dry_run_refuses_a_schedule_past_max_epochs(schedule_file, tmp_path):
    data = yaml.safe_load(schedule_file.read_text())
    schedule_file.write_text(yaml.safe_dump({**data, "max_epochs": {"stores/store2": 0.05}}))
    with pytest.raises(ConfigError, match=r"dataset 2 \('stores/store2'\): the schedule needs 75 of its samples by "
                                          r"the end of phase 3 \(75 in that phase\), more than the \d+ its max_epochs"):
        _run(["build", str(schedule_file), "--cache", str(tmp_path / "c"), "--dry-run"])


def test_a_stateless_build_of_several_phases_runs_from_the_command_line(schedule_file, tmp_path, capsys):
    assert _run(["build", str(schedule_file), "--cache", str(tmp_path / "c"), "--mode", "stateless",
                 "--dry-run"]) == 0
    assert "builds in mode: stateless" not in capsys.readouterr().out  # no note: it builds
    assert _run(["build", str(schedule_file), "--cache", str(tmp_path / "c"), "--mode", "stateless",
                 "--no-progress"]) == 0
    assert (tmp_path / "c").is_dir()


