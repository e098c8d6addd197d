"""A torchtitan dataloader over a tokenloom build, and a torchtitan-shaped training loop that uses it.

    torchrun --nproc-per-node 2 examples/torchtitan_source.py BUILD.yaml --global-batch-size 32 \\
        --steps 50 --checkpoint ckpt            # then --resume, on any number of processes

In a torchtitan job, name the loader in the job's config instead of torchtitan's own::

    from torchtitan_source import TokenloomDataLoader   # this file, copied beside the job's config
    config.dataloader = TokenloomDataLoader.Config(dataset_path="build.yaml", split="train",
                                                   global_batch_size=1024)

Written against torchtitan 0.3.0, the release pip installs. Its trainer builds the dataloader with
``config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=, seq_len=, local_batch_size=,
snapshot_every_n_steps=)``, iterates ``(input_dict, labels)`` pairs, and checkpoints the loader
through torch.distributed.checkpoint (DCP) as a ``Stateful``. :class:`TokenloomDataLoader` takes
that place:

* ``input_dict["input"]`` is the token ids, ``input_dict["positions"]`` the position ids, which
  restart at 0 at every document: torchtitan builds its flex and varlen document masks from
  where positions restart (``get_attention_masks``), so attention stays inside documents;
* ``labels`` is the next tokens with -100 (torchtitan's ``IGNORE_INDEX``) where tokenloom's loss
  mask is 0: the end-of-document targets and best-fit padding;
* every data-parallel rank reads its rows of tokenloom's global batches, exactly as tokenloom's
  own loaders do;
* its state is tokenloom's serving state, the same on every rank, under one key: DCP keeps one
  copy, and a checkpoint saved on any number of ranks restores on any other, where torchtitan's
  own loaders refuse a changed data-parallel degree.

torchtitan's main branch moved past 0.3.0 to grain-based loaders over a ``RandomAccessDataSource``;
``tokenloom.serve.grain_adapter.GrainSource`` is such a source, but this example targets the release
a user can install.

The loop below is torchtitan's, cut to what the data needs: build the loader on every rank, step a
placeholder model (token and position embeddings, the loss torchtitan computes: the sum over the
targets kept, divided by the global number of targets kept), and save and load the loader and the
model with DCP. Every ``--log-every`` steps rank 0 prints the step, the loss, tokens per second and
the share of the time spent waiting for data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.dataloader import ParallelAwareDataloader

import tokenloom
from tokenloom import ConfigError
from tokenloom.serve import BatchGeometry, SampleOptions
from tokenloom.serve.torch_adapter import PackedBatch, ServeDataset, StatefulBatchSampler

IGNORE_INDEX = -100
"""torchtitan's ``IGNORE_INDEX``: a label the loss leaves out."""

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def to_torchtitan(batch: dict[str, torch.Tensor]) -> tuple[PackedBatch, torch.Tensor]:
    """tokenloom's micro-batch as torchtitan's ``(input_dict, labels)``.

    Best-fit padding reads as token -1; it becomes token 0, which no real token attends to (it
    comes after them, under a causal mask) and whose target the loss leaves out.
    """
    labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, IGNORE_INDEX)
    return PackedBatch({"input": batch["tokens"].clamp(min=0), "positions": batch["position_ids"]}), labels


class TokenloomDataLoader(ParallelAwareDataloader):
    """One data-parallel rank's micro-batches of a tokenloom split, in torchtitan's loader shape."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "tokenloom"
        dataset_path: str | None = None
        """The tokenloom build config (YAML or JSON): built, or found in its cache, on every rank."""

        split: str = "train"
        """Which split to serve: train, valid or test."""

        global_batch_size: int = 0
        """Samples per optimizer step over all ranks; 0 takes ``local_batch_size x dp_world_size``.
        Set it to torchtitan's ``training.global_batch_size`` when gradients accumulate, so that
        tokenloom's steps are the trainer's steps."""

        documents: bool = True
        """Position ids restart at every document (torchtitan's document masks need this); False
        counts 0..seq_len-1 across documents."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int,
                 local_batch_size: int, tokenizer: Any = None, snapshot_every_n_steps: int | None = 1,
                 **kwargs: Any) -> None:
        # tokenizer is torchtitan's, unused: the tokens come from the build's stores
        if not config.dataset_path:
            raise ConfigError("TokenloomDataLoader.Config.dataset_path is empty; expected the path of a "
                              "tokenloom build config (YAML or JSON)")
        split = tokenloom.build(config.dataset_path).split(config.split)
        if split.seq_length != seq_len:
            raise ConfigError(f"torchtitan's seq_len={seq_len} but the build {config.dataset_path!r} makes samples of "
                              f"seq_length={split.seq_length}; expected them to agree")
        geometry = BatchGeometry(global_batch_size=config.global_batch_size or local_batch_size * dp_world_size,
                                 micro_batch_size=local_batch_size, dp=dp_world_size)
        options = SampleOptions(eod_mask_loss=True, inter_document_masking=config.documents)
        self._sampler = StatefulBatchSampler(split, geometry, dp_rank=dp_rank)
        self._served = None
        self.build_key = split.build_key
        loader_kwargs = {"batch_sampler": self._sampler, "collate_fn": to_torchtitan,
                         "num_workers": config.num_workers, "pin_memory": config.pin_memory,
                         "persistent_workers": config.persistent_workers,
                         "prefetch_factor": config.prefetch_factor, "snapshot_every_n_steps": snapshot_every_n_steps}
        if loader_kwargs["prefetch_factor"] is None:
            del loader_kwargs["prefetch_factor"]
        super().__init__(ServeDataset(split, options=options, fields=FIELDS), dp_rank=dp_rank,
                         dp_world_size=dp_world_size, **loader_kwargs)

    def __iter__(self):
        # The workers read ahead of the trainer; the state counts what the trainer was given.
        self._served = self._sampler.start()
        for batch in super().__iter__():
            self._served.advance()
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """tokenloom's serving state after the micro-batches yielded: the same on every rank, so
        DCP stores it once and any number of ranks loads it."""
        served = self._served if self._served is not None else self._sampler.start()
        return {"tokenloom": json.dumps(served.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # a checkpoint without a loader: start from the beginning, as torchtitan does
            return
        if "tokenloom" not in state_dict:
            raise ConfigError(f"the checkpoint's dataloader state has keys {sorted(state_dict)}; expected "
                              "'tokenloom' (it was saved by another dataloader)")
        self._sampler.load_state_dict(json.loads(state_dict["tokenloom"]))
        self._served = None

    def reweight(self, weights) -> None:
        """Blend weights from the next step on (after a load, before iterating)."""
        self._sampler.reweight(weights)

    def skip_steps(self, first: int, stop: int) -> None:
        """Never serve the samples of steps ``[first, stop)`` (after a loss spike)."""
        self._sampler.skip_steps(first, stop)


# --------------------------------------------------------------------------- the loop


CLASSES = 512
"""The placeholder model sees token ids modulo this (the pipeline is the point, not the model)."""


class Placeholder(torch.nn.Module):
    """Token and position embeddings into logits: enough to show the batches train a model."""

    def __init__(self, vocab_size: int, seq_len: int, hidden: int = 64) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab_size, hidden)
        self.positions = torch.nn.Embedding(seq_len, hidden)
        self.out = torch.nn.Linear(hidden, vocab_size)

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.tokens(inputs % CLASSES) + self.positions(positions)))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="tokenloom build config (YAML or JSON)")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50, help="train until this step")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--checkpoint", help="DCP directory of the model, the optimizer and the loader")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--losses", help="append each step's loss here, one JSON line per step (rank 0)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    try:
        if args.global_batch_size % world:
            raise ConfigError(f"--global-batch-size {args.global_batch_size} does not divide over {world} ranks")
        local = args.global_batch_size // world
        split = tokenloom.build(args.config).split("train")
        loader = TokenloomDataLoader.Config(dataset_path=args.config, num_workers=args.workers,
                                            pin_memory=device.type == "cuda",
                                            global_batch_size=args.global_batch_size).build(
            dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=split.seq_length, local_batch_size=local)
        torch.manual_seed(0)
        model = Placeholder(CLASSES, split.seq_length).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
        step = 0
        if args.resume:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state, "dataloader": loader,
                     "train": {"step": torch.tensor(0)}}
            dcp.load(state, checkpoint_id=args.checkpoint)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            step = int(state["train"]["step"])
        batches = iter(loader)
        started, tokens, waited = time.perf_counter(), 0, 0.0
        while step < args.steps:
            asked = time.perf_counter()
            try:
                input_dict, labels = next(batches)
            except StopIteration:
                break
            waited += time.perf_counter() - asked
            inputs = input_dict["input"].to(device, non_blocking=True)
            positions = input_dict["positions"].to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = model(inputs, positions)
            kept = (labels != IGNORE_INDEX).sum().float()
            if distributed:
                dist.all_reduce(kept)
            targets = torch.where(labels == IGNORE_INDEX, labels, labels % CLASSES)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                     ignore_index=IGNORE_INDEX, reduction="sum") / kept
            optimizer.zero_grad()
            loss.backward()
            reported = loss.detach().clone()
            if distributed:  # the sum over ranks: every rank's loss is its share of the global mean
                for parameter in model.parameters():
                    dist.all_reduce(parameter.grad)
                dist.all_reduce(reported)
            optimizer.step()
            step += 1
            tokens += labels.numel() * world
            if rank == 0 and args.losses:
                with open(args.losses, "a") as f:
                    f.write(json.dumps({"step": step, "loss": float(reported)}) + "\n")
            if rank == 0 and args.log_every and step % args.log_every == 0:
                elapsed = time.perf_counter() - started
                print(f"step {step}  loss {float(reported):.4f}  {tokens / elapsed:,.0f} tokens/s  "
                      f"data wait {waited / elapsed:.1%}", flush=True)
            if args.checkpoint and step % args.save_every == 0:
                model_state, optimizer_state = get_state_dict(model, optimizer)
                dcp.save({"model": model_state, "optimizer": optimizer_state, "dataloader": loader,
                          "train": {"step": torch.tensor(step)}}, checkpoint_id=args.checkpoint)
        if rank == 0 and args.log_every:
            elapsed = time.perf_counter() - started
            print(f"trained to step {step}: {tokens / elapsed:,.0f} tokens/s, data wait {waited / elapsed:.1%}",
                  flush=True)
    finally:
        if distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
