"""One rank of the tokenloom.megatron test: ``megatron_entry_worker.py RANK WORLD PORT CASE_JSON OUT_DIR``.

Joins a gloo group on 127.0.0.1 as Megatron-LM's ranks would, calls
``tokenloom.megatron.build_megatron_datasets`` with megatron-core's array builders replaced by
ones that fail (so only cache hits load), and writes ``OUT_DIR/rank{RANK}.json``: per split the
dataset length, its description hash and the tokens of a few samples.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    case = json.loads(sys.argv[4])
    out_dir = sys.argv[5]
    import torch.distributed as dist

    from megatron_fixtures import gpt_dataset_config, refusing_megatron_builders

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out: dict = {"rank": rank}
    try:
        from tokenloom.megatron import build_megatron_datasets

        config = gpt_dataset_config(case["config"], case["path_to_cache"])
        with refusing_megatron_builders():
            datasets = build_megatron_datasets(config, case["sizes"], cache_dir=case["cache_dir"], timeout_s=120)
        out["splits"] = [None if d is None else {
            "length": len(d), "md5": d.unique_description_hash,
            "tokens": {str(i): [int(t) for t in d[i]["tokens"]] for i in case["positions"] if i < len(d)},
        } for d in datasets]
    except BaseException:
        out["crashed"] = traceback.format_exc()
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
