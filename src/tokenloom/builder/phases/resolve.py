"""The resolve phase: the config's epoch budgets read from the stores, agreed on by every rank.

:meth:`~tokenloom.builder.config.BuildConfig.resolve` is the one step before the plan that reads
files: the ``.idx`` of every store with an epoch budget. It runs once the build's group is open,
and the ranks agree on its outcome, so a store missing on one rank only (a node-local disk) fails
every rank at once with that rank's message, instead of failing that rank alone while the others
wait for it until their timeout. A config with nothing to read (no epoch budget: the same answer
on every rank, from the config's values) costs no collective, and one process raises resolve's
own error, as it would without a group.
"""

from __future__ import annotations

from tokenloom.builder.collective import agree, failure_from
from tokenloom.builder.config import BuildConfig


def resolve(config: BuildConfig, group) -> BuildConfig:
    """``config.resolve()`` on every rank of ``group``; a failure on any rank raises the same
    BuildError on all of them (on one rank, the failure itself)."""
    if config.resolved or group.world_size == 1:
        return config.resolve()
    resolved, failure = config, None
    try:
        resolved = config.resolve()
    except Exception as exc:
        failure = failure_from(exc, rank=group.rank, phase="resolve", item=None)
    agree(group, failure, phase="resolve")
    return resolved


__all__ = ["resolve"]
