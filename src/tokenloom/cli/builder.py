"""``tokenloom build`` and ``tokenloom cache``: the command-line side of :func:`tokenloom.build`.

``tokenloom build CONFIG`` runs alone or under torchrun (each rank runs the same command); rank 0
prints the plan, a progress bar and the summary. ``tokenloom cache verify DIR`` checks a cache
against its manifests.
"""

from __future__ import annotations

import sys


def add_build_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "build",
        help="build (or reuse) every split's indices from a blend config, on one or many ranks",
        description="Turn a build config (YAML or JSON, Megatron's vocabulary: blend or "
        "blend_per_split, split, seq_length, seed, samples or train_iters x global_batch_size) into "
        "ready indices for every split, cached. Runs alone or under torchrun: every rank builds part "
        "of the work, and all ranks fail together if one fails.",
    )
    p.add_argument("config", metavar="CONFIG",
                   help="build config file (.yaml/.yml or .json); relative paths in it (stores, cache) name "
                        "files beside the config file, wherever the command runs")
    p.add_argument("--cache", metavar="DIR",
                   help="cache directory (overrides cache_dir in CONFIG; a relative DIR is the current directory's)")
    p.add_argument("--mode", choices=("exact", "stateless"),
                   help="exact: megatron-core's arrays bit for bit; stateless: tokenloom's Feistel index")
    p.add_argument("--packing", choices=("concat", "best_fit"),
                   help="concat: documents concatenated and cut into samples (megatron-core's); best_fit: "
                        "whole documents packed best fit into padded samples, long ones cut into pieces")
    p.add_argument("--best-fit-window", type=int, metavar="DOCUMENTS",
                   help="documents packed together with --packing best_fit (default 100000, at least the "
                        "tokens of a sample)")
    p.add_argument("--no-shared-fs", action="store_true",
                   help="ranks do not share the cache directory; results travel over the process group")
    p.add_argument("--megatron-cache", metavar="DIR",
                   help="also write megatron-core's cache files here (its path_to_cache), exact mode")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (items per rank, estimated seconds, memory, cache size) and stop")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="seconds a rank waits for the others before the build fails (default 1800)")
    p.add_argument("--rng-workers", type=int, metavar="N",
                   help="background processes drawing shuffles ahead (exact mode, default 1; only where "
                        "a rank has a core to spare)")
    p.add_argument("--blend-threads", type=int, metavar="N",
                   help="threads of each exact blend (default 0: this rank's share of the host's cores)")
    p.add_argument("--verify-stores", choices=("stat", "hash"),
                   help="stat (default): a store unchanged since the cache's fingerprint memo recorded it "
                        "(size, mtime, ctime, inode, device) is not hashed again; hash: hash every store")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_build)


def run_build(args) -> int:
    import tokenloom
    from tokenloom.builder import load_build_config

    overrides = {
        "cache_dir": args.cache, "mode": args.mode, "megatron_cache_dir": args.megatron_cache,
        "timeout_s": args.timeout, "rng_workers": args.rng_workers, "blend_threads": args.blend_threads,
        "verify_stores": args.verify_stores, "packing": args.packing, "best_fit_window": args.best_fit_window,
    }
    if args.no_shared_fs:
        overrides["shared_fs"] = False
    config = load_build_config(args.config, **overrides)
    bar = {}

    def on_plan(plan, cached) -> None:
        if args.dry_run:
            print(plan.describe(done=cached, cache_dir=config.cache_dir))
            if config.phases is not None:
                print(config.describe_schedule(plan.samples_per_epoch("train")))
                if config.packing != "concat":
                    print("  (a schedule of several phases builds with packing: concat in this release; the train "
                          "split is planned above as one blend of each store's samples over the whole schedule)")
        else:
            print(f"tokenloom build: {len(plan.items)} items, {len(cached)} cached, "
                  f"{len(plan.items) - len(cached)} to build on {plan.world_size} rank(s), "
                  f"estimated {max(plan.seconds_per_rank(), default=0):.1f} s", file=sys.stderr)

    def on_progress(done: int, total: int) -> None:
        if args.no_progress or total == 0:
            return
        if "bar" not in bar:
            from tqdm import tqdm

            bar["bar"] = tqdm(total=total, unit="item", desc="build", file=sys.stderr)
        progress = bar["bar"]
        progress.update(done - progress.n)
        if done >= total:
            progress.close()

    result = tokenloom.build(config, dry_run=args.dry_run, on_plan=on_plan, on_progress=on_progress)
    if args.dry_run or result.rank != 0:
        return 0
    packing = result.packing_report()
    for name, split in result.splits.items():
        line = f"{name}: {split.num_samples:,} samples from {len(split.datasets)} dataset(s)"
        if name in packing:
            report = packing[name]
            line += (f"; best fit: {report.samples_per_epoch:,} samples an epoch, padding "
                     f"{100 * report.padding_fraction:.2f}%, {report.cut_documents:,} of {report.documents:,} "
                     f"documents cut ({100 * report.cut_documents / max(1, report.documents):.2f}%, longer "
                     "than a sample)")
        print(line)
    built = len(result.built_keys)
    warm = " (warm start: stores unchanged, the kept plan taken)" if result.warm_start else ""
    print(f"build {result.build_key}: {len(result.plan.items)} items, {built} built, "
          f"{len(result.plan.items) - built} reused{warm}; manifest {result.manifest_path}")
    timings = "  ".join(f"{k[:-2]} {v:.2f}s" for k, v in result.timings.items() if not k.endswith("_cpu_s"))
    print(f"timings (rank 0): {timings}")
    if built:
        print("rank  predicted s  build wall s  build CPU s")
        for row in result.rank_seconds:
            print(f"{row['rank']:>4}  {row['predicted_s']:>11.2f}  {row['wall_s']:>12.2f}  {row['cpu_s']:>11.2f}")
    return 0


def add_cache_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "cache",
        help="inspect a build cache",
        description="Commands on a tokenloom build cache.",
    )
    commands = p.add_subparsers(dest="cache_command", metavar="COMMAND", required=True)
    verify = commands.add_parser(
        "verify",
        help="check every cached file against its manifest",
        description="Hash every file every manifest lists and compare sizes and SHA-256; name each "
        "missing, truncated or changed file. Exit status 1 when anything is wrong.",
    )
    verify.add_argument("directory", metavar="DIR", help="the cache directory")
    verify.set_defaults(run=run_cache)


def run_cache(args) -> int:
    from tokenloom.builder import verify_cache

    report = verify_cache(args.directory)
    for problem in report.problems:
        print(problem)
    status = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    print(f"{report.root}: {report.manifests} manifest(s), {report.items} items, {report.files} files "
          f"checked: {status}")
    return 0 if report.ok else 1


def register(subparsers) -> None:
    """Add this group's subcommands."""
    add_build_parser(subparsers)
    add_cache_parser(subparsers)


__all__ = ["add_build_parser", "add_cache_parser", "register", "run_build", "run_cache"]
