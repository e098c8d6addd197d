"""Phase 4, transfer: without a shared filesystem, each finished item travels over the group to
one writer per node that lacks it (the bytes of an item: :mod:`tokenloom.builder.transfer`)."""

from __future__ import annotations

from tokenloom.builder.collective import agree
from tokenloom.builder.context import BuildContext
from tokenloom.builder.items import BuildPlan
from tokenloom.builder.packs import PackWriter
from tokenloom.builder.transfer import pack_item, unpack_item
from tokenloom.errors import BuildError


def transfer(ctx: BuildContext, plan: BuildPlan, nodes: dict[int, int], present: dict[int, set],
             built: set[str]) -> None:
    """Send every item a node's writer lacks from the rank that has it (its builder, or a writer
    that held it), one broadcast each, in plan order on every rank."""
    writers = sorted(present)
    failure = None
    packs = PackWriter(ctx.cache)
    try:
        for item in plan.items:
            if item.key in plan.divided:
                continue  # every node's writer received every range while it was built
            needing = [w for w in writers if item.key not in present[w]
                       and not (item.key in built and nodes[plan.assignment[item.key]] == w)]
            if not needing:
                continue
            if item.key in plan.assignment:
                source = plan.assignment[item.key]
            else:
                source = next(w for w in writers if item.key in present[w])
            size_blob = blob = None
            if ctx.rank == source:
                try:
                    blob = pack_item(ctx.cache, item.key)
                except Exception as exc:
                    failure = failure or ctx.failed(exc, "transfer", item.label)
                    blob = b""
                size_blob = len(blob).to_bytes(8, "little")
            try:
                size = int.from_bytes(ctx.group.broadcast_bytes(size_blob, source, 8), "little")
                data = ctx.group.broadcast_bytes(blob, source, size) if size else b""
            except Exception as exc:
                raise BuildError(
                    f"rank {ctx.rank}: the process group failed while receiving {item.label} from "
                    f"rank {source} ({type(exc).__name__}: {exc}); a rank was killed or hung. Rerun "
                    "the build: finished items are reused"
                ) from exc
            if ctx.rank in needing and failure is None and size:
                try:
                    unpack_item(packs, ctx.cache, item.key, data)
                except Exception as exc:
                    failure = ctx.failed(exc, "transfer", item.label)
    finally:
        try:
            packs.close()
        except Exception as exc:
            failure = failure or ctx.failed(exc, "transfer", "publishing a pack")
    agree(ctx.group, failure, phase="transfer")


__all__ = ["transfer"]
