"""Sample sources: one split of a build, readable by position (the layer under build and serve).

The build stage produces sources, the serving stage consumes them.
"""

from tokenloom.source.memory_stateless import StatelessBlendSource
from tokenloom.source.protocol import (
    DatasetInfo,
    SampleSource,
    StoreBlendSource,
    gather_gpt_samples,
    read_positions,
)

__all__ = [
    "DatasetInfo",
    "SampleSource",
    "StatelessBlendSource",
    "StoreBlendSource",
    "gather_gpt_samples",
    "read_positions",
]
