"""Pretrain a small GPT on a tokenloom build: torchrun, DistributedDataParallel, gradient
accumulation, and a checkpoint that resumes on any number of ranks with the identical data.

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --build tokenloom-demo/build.yaml \\
        --steps 60 --global-batch-size 32 --micro-batch-size 4 --checkpoint ckpt --metrics metrics.jsonl
    # later, on one rank: the same global batches from step 60 on
    torchrun --nproc-per-node 1 examples/pretrain_gpt.py --build tokenloom-demo/build.yaml \\
        --steps 120 --global-batch-size 32 --micro-batch-size 4 --checkpoint ckpt --metrics metrics.jsonl --resume

What tokenloom does here, in the order the loop meets it:

1. ``tokenloom.build(BUILD.yaml)`` on every rank: the indices are built once, their work divided
   over the ranks of the job (or opened from the cache when they exist).
2. ``DistributedBatches``: this rank's micro-batches (tokens, labels, loss mask, position ids) of
   one global stream, read ahead by DataLoader workers a whole optimizer step at a time.
3. ``batches.state_dict()``: where the stream is, the same dict on every rank and for every
   number of ranks. It is saved with the model and the optimizer after a whole step, so a job
   stopped at any moment resumes from the last step boundary, on any number of ranks, with the
   global batches it would have seen.

The loss of a step is the mean over every loss-masked token of the global batch, whatever the
number of ranks: each micro-batch's summed loss is divided by the global batch's token count
(Megatron's per-token loss), and the data-parallel average of DistributedDataParallel is undone.
The model is plain PyTorch (pre-norm decoder blocks, causal attention, tied embeddings) and has no
dropout, so a resumed run repeats the uninterrupted one up to float rounding.

``--document-mask`` keeps attention inside each document of a packed sample (as Llama 3 trains):
the loader serves each sample's document boundaries (``SampleOptions(inter_document_masking=True,
boundary_format="thd")``: ``document_ids`` per token, position ids restarting per document, and
the micro-batch's packed ``cu_seqlens`` for FlashAttention or Transformer Engine), and the blocks
attend under a mask built from ``document_ids``: FlexAttention's block mask, compiled, on CUDA;
``scaled_dot_product_attention`` with a dense mask on the CPU, where FlexAttention has no backward
pass. The boundaries come from the index's document pieces, so a store without EOD tokens is
masked too.

Rank 0 prints a line every ``--log-interval`` steps (step, loss, tokens per second, and the share
of the time spent waiting for data) and a summary at the end; ``--quiet`` prints neither.

``--online-mixing LR:EVERY:LAG`` lets the blend weights follow the loss (tokenloom.serve.online):
after every step each rank sums its loss and loss-masked tokens per dataset (by the micro-batch's
``dataset_id``), one all-reduce of that ``(2, datasets)`` tensor gives every rank the same
numbers, and ``batches.report`` hands them to DoReMi's exponentiated-gradient update, which every
EVERY steps scales the build's weights, effective LAG steps later. The decisions and the update's
state are part of the loader's state, so a resume on any number of ranks serves the same weights.
``--min-weight`` keeps every dataset of the blend at least that share.

``--fim-rate R`` trains code with fill-in-the-middle (tokenloom.serve.fim): each sample of the
``--fim-store`` stores (every store without it) is permuted with probability R per piece, PSM or
SPM (``--fim-spm-rate``), as Megatron-LM's ``GPTFIMDataset`` permutes it, from a generator of its
own, so a resume on any number of ranks trains on the same permuted samples. The stores must be
tokenized with a HuggingFace tokenizer whose vocabulary holds the ``--fim-tokens`` sentinels; the
build's seed seeds the draws. The settings are kept in the checkpoint.

``--metrics FILE`` gets one JSON line per optimizer step (rank 0 writes): ``step`` (0-based, as
tokenloom's serving state, audit log and ``tokenloom where --step`` count),
``loss``, ``tokens`` (of the global batch), ``batch_fingerprint`` (of the global batch's samples,
the same for every number of ranks: tokenloom.serve.batch_fingerprint), ``lr``, ``step_s``,
``data_wait_s`` (time this rank waited for its micro-batches), ``dp``, ``weights`` (the blend
weights the step was served with).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the name every PyTorch reader knows
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tokenloom
from tokenloom import ConfigError
from tokenloom.builder import load_build_config
from tokenloom.io import IndexedDataset
from tokenloom.serve import (
    BatchGeometry,
    ExponentiatedGradient,
    FimTransform,
    OnlineMixing,
    SampleOptions,
    Topology,
    batch_fingerprint,
)
from tokenloom.serve.torch_adapter import DistributedBatches
from tokenloom.source import FimOptions
from tokenloom.tokenization import load_tokenizer

CHECKPOINT_FORMAT = "tokenloom-example-gpt-checkpoint"
CHECKPOINT_VERSION = 1
CHECKPOINT_NAME = "checkpoint.pt"
CRASH_ENV = "PRETRAIN_GPT_CRASH_AT"  # "STEP:MICRO" (0-based): exit inside that step's accumulation (tests)


# ------------------------------------------------------------------------------------ the model


def document_mask(document_ids: torch.Tensor):
    """Where token ``q`` may attend to ``kv``: in the same document and ``kv <= q`` (causal inside
    each document), for ``document_ids`` ``(B, S)``.

    On CUDA a FlexAttention block mask, kept as 128 x 128 blocks (empty, full or partial) rather
    than an S x S matrix, for a compiled fused kernel. On the CPU FlexAttention has no backward
    pass, so there it is a dense ``(B, 1, S, S)`` bool mask for ``scaled_dot_product_attention``,
    which this example's sizes afford.
    """
    if document_ids.device.type != "cuda":
        causal = torch.ones(document_ids.shape[1], document_ids.shape[1], dtype=torch.bool,
                            device=document_ids.device).tril()
        same_document = document_ids[:, None, :, None] == document_ids[:, None, None, :]  # (B, 1, S, S)
        return same_document & causal
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_within_document(b, h, q, kv):
        return (document_ids[b, q] == document_ids[b, kv]) & (q >= kv)

    batch, length = document_ids.shape
    return create_block_mask(causal_within_document, batch, None, length, length, device=document_ids.device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Attention under ``mask`` (:func:`document_mask`'s) or causal when it is None."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention)
    return _FLEX(q, k, v, block_mask=mask)


_FLEX = None  # FlexAttention compiled on first use (CUDA)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (inside each document, given
    :func:`document_mask`'s mask), then a 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(hidden, dim=2)
        q, k, v = (t.view(batch, length, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = attend(q, k, v, mask)  # (B, heads, T, head_dim)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, hidden))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    """Token and learned position embeddings, ``layers`` blocks, a final norm, tied output."""

    def __init__(self, vocab_size: int, seq_length: int, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ConfigError(f"--hidden {hidden} is not a multiple of --heads {heads}")
        self.tokens = nn.Embedding(vocab_size, hidden)
        self.positions = nn.Embedding(seq_length, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:  # GPT-2's initialisation; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(parameter, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)``; with ``document_ids`` ``(B, T)`` attention stays inside each
        document."""
        mask = None if document_ids is None else document_mask(document_ids)
        x = self.tokens(tokens) + self.positions(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x) @ self.tokens.weight.T  # (B, T, vocab) logits


# ------------------------------------------------------------------------------------ the job


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", required=True, help="tokenloom build config (YAML or JSON)")
    p.add_argument("--steps", type=int, required=True, help="train until this many optimizer steps in all")
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step, all ranks")
    p.add_argument("--micro-batch-size", type=int, required=True, help="samples per forward pass on one rank")
    p.add_argument("--checkpoint", required=True, help="directory of the checkpoint (model, optimizer, loader)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint")
    p.add_argument("--metrics", help="append one JSON line per optimizer step here (rank 0)")
    p.add_argument("--save-interval", type=int, default=50, help="steps between checkpoints (and the last step)")
    p.add_argument("--log-interval", type=int, default=10,
                   help="rank 0 prints the step, loss, tokens/s and the data wait's share every this many steps")
    p.add_argument("--quiet", action="store_true", help="print no progress lines and no summary")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, help="default: the stores' tokenizer record")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--lr-decay-steps", type=int,
                   help="cosine decay to lr/10 ending at this step (default: constant after warm-up); set it "
                        "once for a whole run: it does not follow --steps, so a resumed run keeps its schedule")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234, help="model initialisation")
    p.add_argument("--document-mask", action="store_true",
                   help="attend only inside each document of a packed sample (FlexAttention over the served "
                        "document boundaries; position ids restart per document). Kept in the checkpoint")
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank reading ahead")
    p.add_argument("--skip-steps", action="append", default=[], metavar="A:B",
                   help="never train on the samples steps A..B-1 would get (0-based, not yet trained; after a loss "
                        "spike, resume from a checkpoint before it); later steps take the samples that follow. "
                        "Kept in the checkpoint. Repeatable")
    p.add_argument("--online-mixing", metavar="LR:EVERY:LAG",
                   help="blend weights that follow each dataset's loss: DoReMi's exponentiated gradient with "
                        "learning rate LR, a decision every EVERY steps taking effect LAG steps later. Kept in the "
                        "checkpoint")
    p.add_argument("--min-weight", type=float, default=0.0, help="with --online-mixing: the least share of a dataset")
    p.add_argument("--fim-rate", type=float, default=None, metavar="R",
                   help="fill-in-the-middle: permute each piece of a code sample with probability R (Megatron-LM's "
                        "fim_rate). Kept in the checkpoint")
    p.add_argument("--fim-spm-rate", type=float, default=0.5, help="with --fim-rate: the share of SPM over PSM")
    p.add_argument("--fim-store", action="append", default=[], metavar="PREFIX",
                   help="with --fim-rate: a store whose samples are permuted (repeatable; default: every store)")
    p.add_argument("--fim-tokens", default="<fim_prefix>,<fim_middle>,<fim_suffix>,<fim_pad>,<|endoftext|>",
                   metavar="P,M,S,PAD,EOD", help="with --fim-rate: the spelling of the prefix, middle, suffix, pad "
                                                  "and end-of-document tokens")
    p.add_argument("--quarantine", action="append", default=[], metavar="PREFIX:DOC",
                   help="never train on a sample holding a piece of document DOC of store PREFIX from now on; kept "
                        "in the checkpoint. Repeatable")
    args = p.parse_args(argv)
    for name in ("steps", "global_batch_size", "micro_batch_size", "save_interval", "log_interval", "layers",
                 "hidden", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}; expected a positive integer")
    return args


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join torchrun's process group (NCCL on GPUs, gloo on the CPU); a plain ``python`` run is
    one rank without a group."""
    if "RANK" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, device
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def vocab_size_of(split, given: int | None) -> int:
    """``--vocab-size``, or the largest vocabulary the split's stores record."""
    if given is not None:
        return given
    sizes = []
    for reader in split.readers:
        record = (IndexedDataset(reader.prefix).metadata or {}).get("tokenizer") or {}
        if record.get("vocab_size") is None:
            raise ConfigError(f"{reader.prefix}: the store records no tokenizer vocabulary size; pass --vocab-size")
        sizes.append(int(record["vocab_size"]))
    return max(sizes)


def learning_rate(args, step: int) -> float:
    """The rate of 0-based optimizer step ``step``: linear warm-up, then constant or cosine decay."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_decay_steps is None:
        return args.lr
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.lr_decay_steps - args.warmup_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def model_config(args, vocab_size: int, seq_length: int) -> dict:
    return {"vocab_size": vocab_size, "seq_length": seq_length, "layers": args.layers, "hidden": args.hidden,
            "heads": args.heads}


def sample_options(args, split=None) -> SampleOptions:
    """What the loader serves: with ``--document-mask`` each sample's document boundaries; with
    ``--fim-rate`` the code stores' samples permuted (``split``'s stores give the tokenizer)."""
    boundaries = {"inter_document_masking": True, "boundary_format": "thd"} if args.document_mask else {}
    if args.fim_rate is None:
        return SampleOptions(**boundaries)
    stores = tuple(args.fim_store) or tuple(dict.fromkeys(d.name for d in split.datasets))
    records = {}
    for reader in split.readers:
        records.setdefault(reader.name, (IndexedDataset(reader.prefix).metadata or {}).get("tokenizer") or {})
    record = records.get(stores[0]) or next(iter(records.values()))
    if record.get("kind") != "huggingface" or not record.get("path"):
        raise ConfigError(f"--fim-rate: {stores[0]} was tokenized with {record.get('kind') or 'no recorded'} "
                          "tokenizer; FIM needs the HuggingFace tokenizer.json it was tokenized with, holding the "
                          "--fim-tokens sentinels")
    names = args.fim_tokens.split(",")
    if len(names) != 5:
        raise ConfigError(f"--fim-tokens {args.fim_tokens!r}; expected five spellings: prefix,middle,suffix,pad,eod")
    options = FimOptions.from_megatron({"fim_rate": args.fim_rate, "fim_spm_rate": args.fim_spm_rate,
                                        "fim_extra_tokens": dict(zip(("prefix", "middle", "suffix", "pad", "eod"),
                                                                     names))})
    transform = FimTransform(options, load_tokenizer(record["path"]), seed=int(load_build_config(args.build).seed))
    return SampleOptions(**boundaries, fim=transform, fim_stores=stores)


def fim_settings(args) -> dict | None:
    """What the checkpoint keeps of ``--fim-*`` (a resume must permute alike)."""
    if args.fim_rate is None:
        return None
    return {"rate": args.fim_rate, "spm_rate": args.fim_spm_rate, "stores": list(args.fim_store),
            "tokens": args.fim_tokens}


def save_checkpoint(path: str, *, step: int, model: nn.Module, optimizer, batches, build_key: str,
                    config: dict, document_mask: bool = False, fim: dict | None = None) -> None:
    """Everything a resume needs, written after a whole optimizer step, atomically (rank 0)."""
    state = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step, "build_key": build_key,
             "model_config": config, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "loader": batches.state_dict(), "document_mask": document_mask, "fim": fim}
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, *, build_key: str, config: dict) -> dict:
    """The checkpoint at ``path``, checked against this run's build and model; a clear error if
    it cannot continue this run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ConfigError(f"--resume: {path} does not exist; start without --resume") from None
    except Exception as exc:
        raise ConfigError(f"--resume: {path} is not a readable checkpoint ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"--resume: {path} is not a checkpoint of this example (format "
                          f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r})")
    if state["build_key"] != build_key:
        raise ConfigError(f"--resume: {path} was saved from build {state['build_key'][:16]}..., but --build gives "
                          f"build {build_key[:16]}...; resuming would train on another data stream. Resume with "
                          "the build the checkpoint was saved from")
    if state["model_config"] != config:
        raise ConfigError(f"--resume: {path} holds a model {state['model_config']}, but the flags give {config}")
    loader = state["loader"]
    if loader.get("micro_batch") != 0 or loader.get("step") != state["step"]:
        raise ConfigError(f"--resume: {path} was not saved at an optimizer step boundary (loader at step "
                          f"{loader.get('step')}, micro-batch {loader.get('micro_batch')}; checkpoint step "
                          f"{state['step']}); this example saves only between steps")
    return state


def online_mixing(args, num_datasets: int) -> OnlineMixing | None:
    """``--online-mixing LR:EVERY:LAG`` as tokenloom's OnlineMixing, or None."""
    if args.online_mixing is None:
        return None
    try:
        rate, every, lag = args.online_mixing.split(":")
        rate, every, lag = float(rate), int(every), int(lag)
    except ValueError:
        raise ConfigError(f"--online-mixing {args.online_mixing!r}; expected LR:EVERY:LAG such as 0.5:10:2") from None
    return OnlineMixing(ExponentiatedGradient(num_datasets, learning_rate=rate), every=every, lag=lag,
                        min_weight=args.min_weight)


def steer(batches, args) -> None:
    """Apply ``--skip-steps`` and ``--quarantine`` (every rank alike; they join the loader's state)."""
    for text in args.skip_steps:
        try:
            first, stop = (int(v) for v in text.split(":"))
        except ValueError:
            raise ConfigError(f"--skip-steps {text!r}; expected A:B (steps A to B-1)") from None
        batches.skip_steps(first, stop)
    items = []
    for text in args.quarantine:
        prefix, _, document = text.rpartition(":")
        if not prefix or not document.isdigit():
            raise ConfigError(f"--quarantine {text!r}; expected PREFIX:DOC, a store prefix and a document id")
        items.append((prefix, int(document)))
    if items:
        batches.quarantine(items)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    try:
        train(args, rank, world, device)
    except ConfigError as exc:
        print(f"pretrain_gpt: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def train(args, rank: int, world: int, device: torch.device) -> None:
    # 1. the data: every rank takes part in the build and opens the same train split
    result = tokenloom.build(args.build)
    split = result.split("train")
    geometry = BatchGeometry(global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                             dp=world)
    accumulation = geometry.num_micro_batches_for(args.global_batch_size)
    mixing = online_mixing(args, len(split.datasets))
    batches = DistributedBatches(split, geometry, Topology(dp=world), rank, mode="every_rank",
                                 num_workers=args.num_workers, device=device, max_steps=args.steps,
                                 options=sample_options(args, split), mixing=mixing)

    # 2. the model, identical on every rank (DDP also broadcasts rank 0's at the start)
    config = model_config(args, vocab_size_of(split, args.vocab_size), split.seq_length)
    torch.manual_seed(args.seed)
    model = GPT(**config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.95))
    path = os.path.join(args.checkpoint, CHECKPOINT_NAME)
    step = 0
    if args.resume:
        state = load_checkpoint(path, build_key=result.build_key, config=config)
        if bool(state.get("document_mask", False)) != args.document_mask:
            raise ConfigError(f"--resume: {path} was trained {'with' if state.get('document_mask') else 'without'} "
                              "--document-mask; resume it the same way (the attention it learned differs)")
        if state.get("fim") != fim_settings(args):
            raise ConfigError(f"--resume: {path} was trained with FIM settings {state.get('fim')}, these flags give "
                              f"{fim_settings(args)}; resume with the same --fim-* flags (the samples differ)")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["loader"])  # any number of ranks: the state is layout-free
        step = state["step"]
    elif os.path.exists(path):
        raise ConfigError(f"{path} exists; pass --resume to continue it, or give another --checkpoint")
    steer(batches, args)
    if rank == 0:
        os.makedirs(args.checkpoint, exist_ok=True)
    ddp = model
    if world > 1:
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    metrics = None
    if args.metrics and rank == 0:
        if args.resume:  # steps logged after the checkpoint are trained again: their lines go
            keep = []
            if os.path.exists(args.metrics):
                with open(args.metrics, encoding="utf-8") as f:
                    keep = [line for line in f if line.strip() and json.loads(line)["step"] < step]
            with open(args.metrics, "w", encoding="utf-8") as f:
                f.writelines(keep)
        metrics = open(args.metrics, "a" if args.resume else "w", encoding="utf-8")
    if step >= args.steps and rank == 0:
        print(f"pretrain_gpt: the checkpoint is at step {step}, --steps is {args.steps}: nothing to train")
    crash = tuple(int(x) for x in os.environ[CRASH_ENV].split(":")) if os.environ.get(CRASH_ENV) else None

    # 3. the loop: one optimizer step per global batch
    progress = Progress(step, quiet=args.quiet or rank != 0)
    try:
        while step < args.steps:
            started = time.perf_counter()
            sampler = batches.sampler  # where the stream is: the same on every rank
            if sampler.exhausted():
                raise ConfigError(f"the build's train split ends after {sampler.step_start:,} samples, before step "
                                  f"{step + 1} of {args.steps}; build with more train samples (train_samples "
                                  "or train_iters x global_batch_size)")
            fingerprint = None
            if metrics is not None:  # of the global batch: the same whatever the number of ranks
                dataset_ids, sample_ids = sampler.stream.locate(sampler.global_batch_positions())
                fingerprint = batch_fingerprint(split.build_key, dataset_ids, sample_ids)
            tokens = sampler.global_batch_size * split.seq_length
            weights = sampler.stream.target_weights(sampler.step_start)  # this step's blend weights
            wait = time.perf_counter()
            micro_batches = [batches.next_batch() for _ in range(accumulation)]
            wait = time.perf_counter() - wait
            # the global batch's loss-masked tokens: every micro-batch's summed loss is divided by it
            counts = torch.stack([b["loss_mask"].sum(dtype=torch.float64) for b in micro_batches]).sum()
            if world > 1:
                dist.all_reduce(counts)
            lr = learning_rate(args, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            total = torch.zeros((), dtype=torch.float64, device=device)
            by_dataset = torch.zeros((2, len(split.datasets)), dtype=torch.float64, device=device)  # tokens, loss
            for m, batch in enumerate(micro_batches):
                if crash == (step, m):
                    print(f"pretrain_gpt: {CRASH_ENV}: exiting inside step {step}", file=sys.stderr, flush=True)
                    os._exit(3)
                last = m == accumulation - 1
                with ddp.no_sync() if world > 1 and not last else contextlib.nullcontext():
                    logits = ddp(batch["tokens"], batch["position_ids"], batch.get("document_ids"))
                    losses = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                                             reduction="none")
                    summed = (losses * batch["loss_mask"].flatten().float()).sum()
                    (summed * (world / counts.float())).backward()  # DDP averages over ranks: undo it
                total += summed.detach().double()
                if mixing is not None:  # each dataset's loss-masked tokens and loss, by sample
                    mask = batch["loss_mask"].double()
                    ids = batch["dataset_id"].long().to(device)
                    by_dataset[0].index_add_(0, ids, mask.sum(dim=1))
                    by_dataset[1].index_add_(0, ids, (losses.detach().double().view_as(mask) * mask).sum(dim=1))
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if world > 1:
                dist.all_reduce(total)
                if mixing is not None:
                    dist.all_reduce(by_dataset)
            if mixing is not None:  # every rank the same numbers: the same decisions
                batches.report(by_dataset[0].cpu().numpy(), by_dataset[1].cpu().numpy())
            step += 1
            loss = float(total / counts)
            if not math.isfinite(loss):
                raise ConfigError(f"the loss is {loss} at step {step}; lower --lr")
            if step % args.save_interval == 0 or step == args.steps:
                if rank == 0:
                    save_checkpoint(path, step=step, model=model, optimizer=optimizer, batches=batches,
                                    build_key=result.build_key, config=config, document_mask=args.document_mask,
                                    fim=fim_settings(args))
                if world > 1:
                    dist.barrier()  # no rank runs ahead of a checkpoint being written
            progress.step(step, loss, tokens, time.perf_counter() - started, wait, args.log_interval)
            if metrics is not None:
                record = {"step": step - 1, "loss": loss, "tokens": tokens,
                          "batch_fingerprint": fingerprint, "lr": lr, "step_s": time.perf_counter() - started,
                          "data_wait_s": wait, "dp": world, "weights": [round(w, 9) for w in weights]}
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
        progress.summary()
    finally:
        if metrics is not None:
            metrics.close()


class Progress:
    """Rank 0's progress lines: every ``--log-interval`` steps the step, the loss, tokens per second
    and the share of the time spent waiting for data since the last line; a summary at the end."""

    def __init__(self, step: int, *, quiet: bool) -> None:
        self.quiet, self.first = quiet, step
        self.window = self.whole = (0, 0.0, 0.0)  # tokens, seconds, seconds waiting for data
        self.loss, self.last = math.nan, step

    def step(self, step: int, loss: float, tokens: int, seconds: float, wait: float, interval: int) -> None:
        self.window = tuple(a + b for a, b in zip(self.window, (tokens, seconds, wait)))
        self.whole = tuple(a + b for a, b in zip(self.whole, (tokens, seconds, wait)))
        self.loss, self.last = loss, step
        if step % interval == 0 and not self.quiet:
            tokens, seconds, wait = self.window
            print(f"step {step}  loss {loss:.4f}  {tokens / seconds:,.0f} tokens/s  data wait {wait / seconds:.1%}",
                  flush=True)
            self.window = (0, 0.0, 0.0)

    def summary(self) -> None:
        tokens, seconds, wait = self.whole
        if self.quiet or not seconds:
            return
        print(f"trained steps {self.first + 1}-{self.last}: final loss {self.loss:.4f}, {tokens:,} tokens in "
              f"{seconds:.1f} s ({tokens / seconds:,.0f} tokens/s), data wait {wait / seconds:.1%} of the time",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
