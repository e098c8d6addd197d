"""Examples that ship with tokenloom: the demo (``tokenloom demo``) runs the main job end to end.

:func:`run_demo` is the command's body: it writes the demo's stores, build config and cache into a
folder, builds, and serves a few steps of a simulated DP x TP x PP job.
"""

from tokenloom.examples.demo import run_demo

__all__ = ["run_demo"]
