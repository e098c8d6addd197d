"""Run by test_serve_torch.py under torchrun: one rank of a tp=2 x pp=2 job saves what it got
(tensor rank 0 broadcasting, every rank loading, and broadcasting the document boundaries, which
every rank then packs per micro-batch; and broadcasting a schedule's steps of two sequence
lengths, which receivers size from the positions alone)."""

import json
import sys

import numpy as np
import torch.distributed as dist

import tokenloom
from tokenloom.serve import BatchGeometry, MixtureAudit, SampleOptions, Topology
from tokenloom.serve.torch_adapter import DistributedBatches, tensor_parallel_group
from tokenloom.source import StoreBlendSource


def main() -> None:
    config = json.load(open(sys.argv[1]))
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        topology = Topology(dp=1, tp=2, pp=2)
        source = StoreBlendSource.from_prefixes(config["prefixes"], config["weights"],
                                                num_samples=config["num_samples"],
                                                seq_length=config["seq_length"], seed=config["seed"])
        geometry = BatchGeometry(global_batch_size=4, micro_batch_size=2, dp=1)
        group = tensor_parallel_group(topology, rank)
        documents = SampleOptions(inter_document_masking=True, boundary_format="thd")
        runs = tokenloom.build(config["length_runs"]).split("train")  # built by the test: opened from the cache
        for name, mode, workers, options, served, steps in (
                ("broadcast", "broadcast", 1, SampleOptions(), source, 3),
                ("every_rank", "every_rank", 0, SampleOptions(), source, 3),
                ("documents", "broadcast", 1, documents, source, 3),
                ("length_runs", "broadcast", 1, SampleOptions(), runs, 4)):
            audit = MixtureAudit(f"{config['out']}/{name}-audit.jsonl") if rank == 0 else None
            batches = DistributedBatches(served, geometry, topology, rank, mode=mode, tp_group=group,
                                         num_workers=workers, max_steps=steps, audit=audit, options=options)
            saved = {}
            for n, batch in enumerate(batches):
                for k, v in batch.items():
                    saved[f"{n}/{k}"] = v.numpy()
            np.savez(f"{config['out']}/{name}-rank{rank}.npz", **saved)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
