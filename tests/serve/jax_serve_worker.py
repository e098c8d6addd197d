"""Run by test_serve_jax.py: one of 2 JAX processes, 4 CPU devices each, records its shards (with
MaxText's packed-input fields, inputs_segmentation and inputs_position), through HostLoader and
through grain (GrainStream sharded by grain's ShardByJaxProcess, where grain is installed), and
the grain iterator's state after 3 steps."""

import json
import sys

import jax
import numpy as np

from tokenloom.serve import SampleOptions
from tokenloom.serve.jax_adapter import HostLoader, ShardOptions, make_global_batch
from tokenloom.source import StoreBlendSource


def record_shards(batches, mesh) -> tuple[list, list]:
    """Every 2-D field's shards of each step's global array: (step, field, first row, stop, rows)."""
    shards, global_shape = [], None
    for step, host_batch in enumerate(batches):
        batch = make_global_batch(host_batch, mesh)
        for field, array in batch.items():
            if array.ndim != 2:
                continue
            global_shape = list(array.shape)
            for shard in array.addressable_shards:
                rows = shard.index[0]
                shards.append([step, field, rows.start, rows.stop, np.asarray(shard.data).tolist()])
    return shards, global_shape


def main() -> None:
    config = json.load(open(sys.argv[1]))
    process_id = int(sys.argv[2])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{config['port']}", num_processes=2,
                               process_id=process_id, initialization_timeout=120)
    try:
        source = StoreBlendSource.from_prefixes(config["prefixes"], [0.3, 0.7], num_samples=300, seq_length=8, seed=2)
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        loader = HostLoader(source, global_batch_size=16, shard=ShardOptions.from_jax(),
                            options=SampleOptions(eod_mask_loss=True, inter_document_masking=True,
                                                  boundary_format="segments"), max_steps=3)
        shards, global_shape = record_shards(loader, mesh)
        record = {"local_devices": jax.local_device_count(), "global_shape": global_shape, "shards": shards}
        try:
            import grain
        except ImportError:
            grain = None
        if grain is not None:
            from tokenloom.serve.grain_adapter import GrainStream

            stream = GrainStream(source, global_batch_size=16, shard=grain.sharding.ShardByJaxProcess(),
                                 options=SampleOptions(eod_mask_loss=True, inter_document_masking=True,
                                                       boundary_format="segments"), max_steps=3)
            iterator = iter(stream)
            record["grain_shards"], _ = record_shards(iterator, mesh)
            record["grain_state"] = iterator.get_state()
        with open(f"{config['out']}/process{process_id}.json", "w") as f:
            json.dump(record, f)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
