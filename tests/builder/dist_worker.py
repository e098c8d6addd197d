"""One rank of a multi-process build test: ``dist_worker.py RANK WORLD PORT STEPS_JSON OUT_DIR``.

Joins a gloo group on 127.0.0.1, runs each step (a build with an optional injected fault), and
writes ``OUT_DIR/rank{RANK}.json`` with every step's outcome. A step is a mapping:

* ``config``: the build config mapping (``{rank}`` in any of its strings is replaced by the rank);
* ``fault``: optional ``{"rank": r, "item_kind": "gpt"|"blend"|"pack", "action": "raise"|"kill"|"hang"}``
  ("hang" stops the process with SIGSTOP: alive, its sockets open, never answering);
* ``dry_run``: optional bool.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    steps = json.loads(sys.argv[4])
    out_dir = sys.argv[5]
    from datetime import timedelta

    import torch.distributed as dist

    from tokenloom.builder.runner import build as build_with_hooks
    from tokenloom.errors import BuildError

    results = {"rank": rank, "steps": []}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        for step in steps:
            config = json.loads(json.dumps(step["config"]).replace("{rank}", str(rank)))
            fault = step.get("fault")

            def before_item(item, build_rank, fault=fault):
                if fault and build_rank == fault["rank"] and item.kind == fault["item_kind"]:
                    if fault["action"] == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if fault["action"] == "hang":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    raise RuntimeError(f"injected fault on rank {build_rank}")

            started = time.monotonic()
            outcome = {"seconds": None}
            try:
                result = build_with_hooks(config, dry_run=step.get("dry_run", False), _before_item=before_item)
                outcome.update(ok=True, built=sorted(result.built_keys),
                               num_samples={n: s.num_samples for n, s in result.splits.items()},
                               build_key=result.build_key, warm_start=result.warm_start,
                               first=[int(v) for v in result.split("train")[0][:8]])
            except BuildError as exc:
                outcome.update(ok=False, error_type=type(exc).__name__, error=str(exc))
            outcome["seconds"] = time.monotonic() - started
            results["steps"].append(outcome)
            _write(out_dir, rank, results)
    except BaseException:
        results["crashed"] = traceback.format_exc()
    finally:
        _write(out_dir, rank, results)
        dist.destroy_process_group()


def _write(out_dir: str, rank: int, results: dict) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
