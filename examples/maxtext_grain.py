"""A MaxText-shaped input pipeline on tokenloom: a grain dataset per host, global ``jax.Array``s.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/maxtext_grain.py BUILD.yaml \\
        --global-batch-size 32 --steps 50 --checkpoint ckpt
    # several hosts: the same command on each, with --coordinator HOST:PORT --num-processes N --process-id I

What MaxText's grain pipeline does, with tokenloom's stream underneath:

1. every host calls ``tokenloom.build(config)`` (one cache, or each host's own: the build is the
   same on every host);
2. each host takes its shard of every global batch through grain: ``GrainStream`` sharded by
   ``jax.process_index()`` / ``jax.process_count()``, read by ``--workers`` grain worker processes
   (``mp_prefetch``), with MaxText's packed-input fields (``inputs_segmentation``,
   ``inputs_position``);
3. the host's rows become one global ``jax.Array`` per field, formed as MaxText's
   ``MultiHostDataLoadIterator`` forms them: split over the host's devices, ``device_put``, and
   ``jax.make_array_from_single_device_arrays`` over a mesh whose one axis is the data;
4. a jitted step trains a placeholder model on them (a bigram table; the loss masked by
   ``loss_mask``, which keeps padding and end-of-document targets out);
5. ``--checkpoint DIR`` keeps grain's iterator state every ``--save-every`` steps (grain's
   ``process_<i>-of-<n>.json``, holding tokenloom's serving state, the same on every host) and
   the model; ``--resume`` continues from it on any number of hosts, with the same number of
   grain workers (grain restores one state per worker).

Every ``--log-every`` steps process 0 prints the step, the loss and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def global_array(host_rows, mesh):
    """One field's global array from this host's rows, as MaxText's MultiHostDataLoadIterator makes it."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    global_shape = (jax.process_count() * host_rows.shape[0], *host_rows.shape[1:])
    pieces = np.split(np.ascontiguousarray(host_rows), len(mesh.local_devices), axis=0)
    buffers = jax.device_put(pieces, mesh.local_devices)
    return jax.make_array_from_single_device_arrays(global_shape, sharding, buffers)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="tokenloom build config (YAML or JSON)")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50, help="train until this step")
    parser.add_argument("--workers", type=int, default=2, help="grain worker processes (0: read in this process)")
    parser.add_argument("--learning-rate", type=float, default=20.0)
    parser.add_argument("--checkpoint", help="directory of the grain state and the model")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--losses", help="append each step's loss here, one JSON line per step (process 0)")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0, for several hosts")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    args = parser.parse_args(argv)

    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags (MaxText's main parses them)
    import grain
    import jax
    import jax.numpy as jnp
    import numpy as np

    import tokenloom
    from tokenloom.serve import SampleOptions
    from tokenloom.serve.grain_adapter import GrainStream
    from tokenloom.serve.jax_adapter import ShardOptions

    if args.coordinator:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    split = tokenloom.build(args.config).split("train")
    # one data axis over every device; Auto, as MaxText's meshes: the compiler shards the step's
    # intermediates from the batch's sharding (JAX's default Explicit axes want every one spelt out)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    stream = GrainStream(split, global_batch_size=args.global_batch_size, shard=ShardOptions.from_jax(),
                         options=SampleOptions(eod_mask_loss=True, inter_document_masking=True,
                                               boundary_format="segments"), max_steps=args.steps)
    dataset = stream.mp_prefetch(grain.MultiprocessingOptions(num_workers=args.workers)) if args.workers else stream
    iterator = iter(dataset)

    # the model is a placeholder (the pipeline is the point): a bigram table over ids modulo 512
    classes = 512
    params = {"bigram": jnp.zeros((classes, classes), jnp.float32)}
    step = 0
    if args.resume:
        with open(os.path.join(args.checkpoint, "model.json")) as f:
            saved = json.load(f)
        step = saved["step"]
        params = {name: jnp.asarray(np.load(os.path.join(args.checkpoint, f"{name}.npy"))) for name in params}
        # tokenloom's serving state is the same on every host, so process 0's file resumes any host count
        with open(os.path.join(args.checkpoint, saved["grain_file"])) as f:
            iterator.set_state(json.load(f))

    @jax.jit
    def train_step(params, batch):
        def loss_fn(p):
            logits = p["bigram"][batch["tokens"] % classes]  # (B, S, classes)
            log_probs = jax.nn.log_softmax(logits, axis=-1)
            picked = jnp.take_along_axis(log_probs, (batch["labels"] % classes)[..., None], axis=-1)[..., 0]
            mask = batch["loss_mask"]
            return -(picked * mask).sum() / jnp.maximum(mask.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - args.learning_rate * g, params, grads), loss

    started, tokens = time.perf_counter(), 0
    while step < args.steps:
        try:
            host_batch = next(iterator)
        except StopIteration:
            break
        batch = {name: global_array(host_batch[name], mesh) for name in ("tokens", "labels", "loss_mask")}
        params, loss = train_step(params, batch)
        step += 1
        tokens += int(np.prod(batch["tokens"].shape))
        if jax.process_index() == 0:
            if args.losses:
                with open(args.losses, "a") as f:
                    f.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")
            if args.log_every and step % args.log_every == 0:
                rate = tokens / (time.perf_counter() - started)
                print(f"step {step}  loss {float(loss):.4f}  {rate:,.0f} tokens/s", flush=True)
        if args.checkpoint and step % args.save_every == 0:
            save(args.checkpoint, step, params, iterator)
    return 0


def save(directory: str, step: int, params, iterator) -> None:
    """grain's state of this host (``process_<i>-of-<n>.json``) and, on process 0, the model."""
    import jax
    import numpy as np

    os.makedirs(directory, exist_ok=True)
    name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    with open(os.path.join(directory, name + ".tmp"), "w") as f:
        json.dump(iterator.get_state(), f)
    os.replace(os.path.join(directory, name + ".tmp"), os.path.join(directory, name))
    if jax.process_index() == 0:
        for name, value in params.items():
            np.save(os.path.join(directory, f"{name}.npy"), np.asarray(value))
        with open(os.path.join(directory, "model.json.tmp"), "w") as f:
            json.dump({"step": step, "grain_file": f"process_0-of-{jax.process_count()}.json"}, f)
        os.replace(os.path.join(directory, "model.json.tmp"), os.path.join(directory, "model.json"))


if __name__ == "__main__":
    sys.exit(main())
