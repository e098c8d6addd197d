"""Megatron-LM's phase relaunches as one tokenloom schedule: the same curriculum, and no store
reads its first samples again at a phase change.

    python examples/megatron_phases.py --work /tmp/megatron-phases
    python examples/megatron_phases.py --work /tmp/megatron-phases --mode stateless --steps 40 70 90

Megatron-LM trains a curriculum (a main mix, then mid-training, then an anneal) as one launch per
phase: ``--phase-transition-iterations 40,70`` saves and exits at iterations 40 and 70
(NVIDIA/Megatron-LM#2938), and the user relaunches with the next phase's ``--data-path``. Each
relaunch sizes a new blend to its own phase's samples and reads it from its first position
(``get_train_valid_test_num_samples`` and ``build_train_valid_test_data_loaders`` in
``megatron/training/training.py``), so every store starts over: a store used in two phases serves
its first samples again, and the ones after them are never reached.

With tokenloom the same phase list is one build config, ``phases:``, each phase ending
``until: {steps: N}``: one build sizes every store for the whole run, and at every phase boundary
each store goes on with its next sample. This script:

1. makes a small corpus: three stores of byte-tokenized standard-library sources;
2. writes the Megatron-LM job as its launches (:data:`MEGATRON_LAUNCHES`: the iteration each
   phase ends at and its ``--data-path``) and prints each launch's arguments;
3. turns the launches into a tokenloom build config (:func:`phases_config`), written as
   ``build.yaml``;
4. builds it and serves the whole run with ``RankLoader``, one optimizer step after another,
   asking ``split.where`` which store and document pieces each served sample holds;
5. replays the relaunches with megatron-core's own ``BlendedMegatronDatasetBuilder`` (when
   megatron-core is installed), each phase sized and read from position 0 as Megatron-LM does;
6. prints, per phase, the samples each store served and how many of them an earlier phase had
   served already: a sample is the same when its store and document pieces (which documents,
   from which token, how many tokens) are.

To train Megatron-LM on the schedule, serve it with tokenloom rather than megatron-core, which
has one blend per split and cannot load a split of several phases: Megatron-LM's
``--dataloader-type external`` passes what the dataset provider returns straight through as its
data iterator, so the provider can return tokenloom's ``DistributedBatches`` (keep its
``state_dict()`` with the checkpoint, as ``examples/pretrain_gpt.py`` does).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import numpy as np
import yaml

import tokenloom
from tokenloom.serve import BatchGeometry, RankLoader
from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

#: The Megatron-LM job, one launch per phase: its ``--data-path`` (weights and store names, as
#: Megatron-LM reads them), and with ``--steps`` the iteration each phase ends at.
MEGATRON_LAUNCHES = (
    "0.7 web 0.3 code",             # main mix
    "0.4 web 0.3 code 0.3 math",    # mid-training: math enters
    "0.2 web 0.3 code 0.5 math",    # anneal
)
STORES = ("web", "code", "math")


def make_corpus(directory: str) -> dict[str, str]:
    """Three byte-tokenized stores of the standard library's sources (a module per document),
    each from a third of the modules; name -> prefix."""
    library = os.path.dirname(os.__file__)
    modules = sorted(os.path.join(library, f) for f in os.listdir(library) if f.endswith(".py"))
    prefixes = {}
    for k, name in enumerate(STORES):
        prefix = os.path.join(directory, "stores", name)
        if not os.path.exists(prefix + ".idx"):
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
            tokenize_to_store(modules[k::len(STORES)], prefix, TokenizeConfig(tokenizer="bytes", workers=0))
        prefixes[name] = prefix
    return prefixes


def data_path(launch: str, prefixes: dict[str, str]) -> list[str]:
    """A launch's ``--data-path`` with each store name replaced by its prefix."""
    return [prefixes.get(word, word) for word in launch.split()]


def megatron_arguments(ends: list[int], global_batch_size: int, prefixes: dict[str, str]) -> list[str]:
    """The arguments of each Megatron-LM launch: the phase list on every launch, ``--load`` from
    the second on, and the phase's ``--data-path``. The run's end is ``--train-samples``: the
    phase code reads the last phase's end from it."""
    common = (f"--phase-transition-iterations {','.join(str(e) for e in ends[:-1])} "
              f"--global-batch-size {global_batch_size} --train-samples {ends[-1] * global_batch_size} --save ckpt")
    return [f"{common}{' --load ckpt' if k else ''} --data-path {' '.join(data_path(launch, prefixes))}"
            for k, launch in enumerate(MEGATRON_LAUNCHES)]


def phases_config(ends: list[int], prefixes: dict[str, str], **settings) -> dict:
    """The launches as one tokenloom build config: phase k is launch k's ``--data-path`` until
    step ``ends[k]`` (Megatron-LM's iteration count: the steps done when the launch exits)."""
    phases = [{"blend": data_path(launch, prefixes), "until": {"steps": end}}
              for launch, end in zip(MEGATRON_LAUNCHES, ends)]
    return {"phases": phases, **settings}


def tokenloom_phases(build: str, ends: list[int], global_batch_size: int, micro_batch_size: int) -> list[list[tuple]]:
    """Serve the whole run; the identity ``(store, pieces)`` of every sample, phase by phase."""
    split = tokenloom.build(build).split("train")
    geometry = BatchGeometry(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp=1)
    served: list[list[tuple]] = [[] for _ in ends]
    loader = RankLoader(split, geometry, max_steps=ends[-1])
    for k, batch in enumerate(loader):  # one process: micro-batch k holds positions k * micro + [0, micro)
        positions = np.arange(k * micro_batch_size, (k + 1) * micro_batch_size)
        origins = split.where(positions)
        if [o.dataset for o in origins] != batch["dataset_id"].tolist():
            raise SystemExit(f"micro-batch {k}: the loader served datasets {batch['dataset_id'].tolist()}, "
                             f"where() says {[o.dataset for o in origins]}")
        phase = int(np.searchsorted(ends, k * micro_batch_size // global_batch_size, side="right"))
        served[phase] += [(os.path.basename(o.prefix), tuple((p.document, p.offset, p.length) for p in o.pieces))
                          for o in origins]
    return served


def megatron_relaunches(ends: list[int], global_batch_size: int, prefixes: dict[str, str], *, seq_length: int,
                        seed: int, cache: str) -> list[list[tuple]] | None:
    """Each launch as Megatron-LM runs it: a new blend of the phase's ``--data-path`` sized to the
    phase's samples, read from position 0; the identity of every sample read. None without
    megatron-core."""
    try:
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    except ImportError:
        return None
    served = []
    for k, launch in enumerate(MEGATRON_LAUNCHES):
        words = data_path(launch, prefixes)
        size = (ends[k] - (ends[k - 1] if k else 0)) * global_batch_size
        config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length,
                                  blend=(words[1::2], [float(w) for w in words[0::2]]), split="100,0,0",
                                  path_to_cache=cache, tokenizer=NullTokenizer(257), reset_position_ids=False,
                                  reset_attention_mask=False, eod_mask_loss=False)
        train = BlendedMegatronDatasetBuilder(GPTDataset, [size, 0, 0], lambda: True, config).build()[0]
        phase = []
        for position in range(size):
            dataset = train.datasets[train.dataset_index[position]]
            phase.append((os.path.basename(dataset.dataset.path_prefix),
                          gpt_pieces(dataset, int(train.dataset_sample_index[position]))))
        served.append(phase)
    return served


def gpt_pieces(dataset, sample: int) -> tuple:
    """The document pieces ``(document, offset, length)`` megatron-core's ``GPTDataset[sample]``
    reads: the first document from its offset, the last to its offset plus the extra token."""
    row = int(dataset.shuffle_index[sample])
    (first, begin), (last, end) = dataset.sample_index[row], dataset.sample_index[row + 1]
    extra = int(dataset.config.add_extra_token_to_sequence)
    pieces = []
    for position in range(int(first), int(last) + 1):
        document = int(dataset.document_index[position])
        offset = int(begin) if position == first else 0
        stop = int(end) + extra if position == last else int(dataset.dataset.sequence_lengths[document])
        if stop > offset:
            pieces.append((document, offset, stop - offset))
    return tuple(pieces)


def rereads(served: list[list[tuple]]) -> list[int]:
    """Per phase, the samples an earlier phase of the run had served already."""
    seen: set = set()
    out = []
    for phase in served:
        out.append(sum(sample in seen for sample in phase))
        seen.update(phase)
    return out


def report(ends: list[int], global_batch_size: int, systems: dict[str, list[list[tuple]]]) -> str:
    lines = [f"{'phase':>5} {'steps':>9} {'samples':>8}  " + "  ".join(
        f"{name + ': ' + ' / '.join(STORES):>30} {'re-read':>8}" for name in systems)]
    counts = {name: rereads(served) for name, served in systems.items()}
    for k, end in enumerate(ends):
        start = ends[k - 1] if k else 0
        cells = []
        for name, served in systems.items():
            per_store = Counter(store for store, _ in served[k])
            cells.append(f"{' / '.join(str(per_store[s]) for s in STORES):>30} {counts[name][k]:>8}")
        lines.append(f"{k + 1:>5} {f'{start}-{end}':>9} {(end - start) * global_batch_size:>8}  " + "  ".join(cells))
    lines.append("")
    for name, served in systems.items():
        total = sum(len(p) for p in served)
        lines.append(f"{name}: {sum(counts[name]):,} of {total:,} samples re-read at a phase change "
                     f"({100 * sum(counts[name]) / total:.1f}%)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="directory for the corpus, build.yaml and the caches")
    parser.add_argument("--steps", type=int, nargs=3, default=[40, 70, 90],
                        help="the iteration each launch ends at: --phase-transition-iterations, then the run's end")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--mode", choices=("exact", "stateless"), default="exact")
    args = parser.parse_args(argv)
    ends, gbs = list(args.steps), args.global_batch_size
    prefixes = make_corpus(args.work)
    print("Megatron-LM: one launch per phase, each relaunch with the next --data-path:")
    for k, line in enumerate(megatron_arguments(ends, gbs, prefixes), 1):
        print(f"  launch {k}: pretrain_gpt.py ... {line}")
    config = phases_config(ends, prefixes, global_batch_size=gbs, seq_length=args.seq_length, split="100,0,0",
                           valid_samples=0, test_samples=0, seed=1234, mode=args.mode,
                           cache_dir=os.path.join(args.work, f"cache-{args.mode}"))
    build = os.path.join(args.work, f"build-{args.mode}.yaml")
    with open(build, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    print(f"\ntokenloom: one build, one run ({build}):\n")
    print(yaml.safe_dump({"phases": config["phases"]}, sort_keys=False, default_flow_style=None).rstrip())
    systems = {f"tokenloom {args.mode}": tokenloom_phases(build, ends, gbs, args.micro_batch_size)}
    replay = megatron_relaunches(ends, gbs, prefixes, seq_length=args.seq_length, seed=1234,
                                 cache=os.path.join(args.work, "megatron-cache"))
    if replay is None:
        print("\n(megatron-core is not installed: its relaunches are left out)", file=sys.stderr)
    else:
        systems["megatron-core relaunch"] = replay
    print("\nsamples served per store, and re-read (served by an earlier phase already):\n")
    print(report(ends, gbs, systems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
