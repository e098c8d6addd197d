"""Pictures: the realised mixture of a serving run, and the memory of a plan's best layouts.

``tokenloom audit LOG --plot mixture.png`` and ``tokenloom plan ... --plot memory.png`` call these.
matplotlib is an optional extra (``pip install 'tokenloom[plot]'``), imported when a picture is
drawn, with the Agg backend (no display needed); without it a ConfigError says what to install.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from tokenloom.errors import ConfigError

#: Figure size in inches and resolution: PNGs of 1100 x 550 pixels (the memory picture grows in
#: height with the layouts shown).
MIXTURE_SIZE = (11.0, 5.5)
DPI = 100


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("drawing a plot needs matplotlib, an optional extra: pip install 'tokenloom[plot]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"{path}: directory {directory} does not exist")
    tmp = f"{path}.tmp-{os.getpid()}.png"
    try:
        fig.savefig(tmp, dpi=DPI, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def plot_mixture(log, path: str, *, max_datasets: int = 8) -> str:
    """Draw an audit log (a ``tokenloom.serve.audit.AuditLog``): each dataset's realised share of
    the tokens served so far against the share its weights asked for, over the steps; weight
    changes and skipped samples marked. The ``max_datasets`` largest (by final target) are drawn
    one by one, the rest summed as "other". A log of a mixture schedule (records with ``phase``)
    gets a second panel above: each step's target (constant in a phase, sloped in a ramp) beside
    the share each step really served, with the phase boundaries marked in both. Returns ``path``."""
    import numpy as np

    records = log.records
    if not records:
        raise ConfigError(f"{log.path}: the audit log has no steps to plot")
    plt = _pyplot()
    names = list(log.header["datasets"])
    steps = np.array([r["step"] for r in records])
    cumulative = np.array([r["cumulative_tokens"] for r in records], dtype=np.float64)  # (S, D)
    totals = np.maximum(cumulative.sum(axis=1, keepdims=True), 1.0)
    realised = cumulative / totals
    target = realised - np.array([r["drift"] for r in records], dtype=np.float64)  # cumulative expectation
    order = np.argsort(-target[-1], kind="stable")
    shown = order[:max_datasets]
    rest = order[max_datasets:]

    def grouped(values):  # (S, D) -> one column per series drawn
        columns = [values[:, d] for d in shown]
        return columns + ([values[:, rest].sum(axis=1)] if rest.shape[0] else [])

    labels = [os.path.basename(str(names[d])) or str(names[d]) for d in shown]
    if rest.shape[0]:
        labels.append(f"other ({rest.shape[0]} datasets)")
    phases = [r.get("phase") for r in records]
    scheduled = any(p is not None for p in phases)
    if scheduled:
        fig, (now, ax) = plt.subplots(2, 1, figsize=(MIXTURE_SIZE[0], 2 * MIXTURE_SIZE[1] - 1.0), sharex=True)
    else:
        fig, ax = plt.subplots(figsize=MIXTURE_SIZE)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (label, got, want) in enumerate(zip(labels, grouped(realised), grouped(target))):
        color = colors[k % len(colors)]
        # the realised share as a wide pale band, the target dashed on top of it: where they agree
        # (a well-mixed blend) both stay visible
        ax.plot(steps, got, color=color, linewidth=3.0, alpha=0.45, zorder=2, label=f"{label}: realised")
        ax.plot(steps, want, color=color, linewidth=1.3, linestyle=(0, (4, 2)), zorder=3, label=f"{label}: target")
    if scheduled:
        _draw_step_shares(now, records, steps, phases, grouped, colors)
    if any(r.get("weights_changed") for r in records) or scheduled:  # a ramp's steps are not changes
        changes = [int(r["step"]) for r in records if r.get("weights_changed")]
    else:
        weights = [tuple(r["target_weights"]) for r in records]
        changes = [int(steps[i]) for i in range(1, len(records)) if weights[i] != weights[i - 1]]
    for axes in (ax, now) if scheduled else (ax,):
        for i, step in enumerate(changes):
            axes.axvline(step, color="0.35", linestyle=":", linewidth=1.2,
                         label="weights changed" if i == 0 and axes is ax else None)
    skipped = [(int(r["step"]), int(r.get("skipped_samples", 0))) for r in records if r.get("skipped")]
    for i, (step, count) in enumerate(skipped):
        ax.axvspan(step - 0.5, step + 0.5, color="tab:red", alpha=0.25,
                   label="samples skipped before the step" if i == 0 else None)
        ax.annotate(f"{count:,} skipped", (step, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -12),
                    textcoords="offset points", fontsize=8, color="tab:red")
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))  # steps are whole
    ax.set_ylabel("share of tokens served so far")
    ax.set_ylim(0.0, min(1.0, max(0.05, float(np.max(np.concatenate([realised, target], axis=1))) * 1.15)))
    ax.grid(True, alpha=0.3)
    title = (f"Realised mixture over {len(records)} steps (build {str(log.header['build_key'])[:12]}): "
             "pale realised, dashed target")
    (now if scheduled else ax).set_title(title)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def _draw_step_shares(ax, records, steps, phases, grouped, colors) -> None:
    """Each step's target (the phase's weights; a ramp moves them every step, so it is a sloped
    line) and each step's realised share, averaged over a few steps inside each phase so that
    small global batches do not hide it; phase boundaries as labelled vertical lines."""
    import numpy as np

    tokens = np.array([r["tokens"] for r in records], dtype=np.float64)  # (S, D)
    share = tokens / np.maximum(tokens.sum(axis=1, keepdims=True), 1.0)
    wanted = np.array([r["target_weights"] for r in records], dtype=np.float64)
    window = max(1, len(records) // 60)
    smooth = np.empty_like(share)
    starts = [0] + [i for i in range(1, len(records)) if phases[i] != phases[i - 1]] + [len(records)]
    for a, b in itertools.pairwise(starts):  # a moving mean that never crosses a phase boundary
        cum = np.concatenate([np.zeros((1, share.shape[1])), np.cumsum(share[a:b], axis=0)])
        idx = np.arange(b - a)
        lo, hi = np.maximum(idx - window // 2, 0), np.minimum(idx + window // 2 + 1, b - a)
        smooth[a:b] = (cum[hi] - cum[lo]) / (hi - lo)[:, None]
    for k, (got, want) in enumerate(zip(grouped(smooth), grouped(wanted))):
        color = colors[k % len(colors)]
        # a step's share holds for the whole step: drawn as stairs (a ramp's are one sample high)
        ax.plot(steps, got, color=color, linewidth=3.0, alpha=0.45, zorder=2, drawstyle="steps-post")
        ax.plot(steps, want, color=color, linewidth=1.3, linestyle=(0, (4, 2)), zorder=3, drawstyle="steps-post")
    for i in starts[1:-1]:
        ax.axvline(int(steps[i]), color="0.2", linewidth=1.0)
    for a in starts[:-1]:
        if phases[a] is not None:
            ax.annotate(f"phase {phases[a]}", (int(steps[a]), 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -12), textcoords="offset points", fontsize=8, color="0.2")
    ax.set_ylabel(f"share of each step (mean of {window})" if window > 1 else "share of each step")
    ax.set_ylim(0.0, min(1.0, max(0.05, float(max(smooth.max(), wanted.max())) * 1.15)))
    ax.grid(True, alpha=0.3)


def plot_memory(plan, path: str, *, top: int = 5, model_name: str | None = None, gpu_name: str | None = None) -> str:
    """Draw a plan (a ``tokenloom.planning.Plan``): memory per GPU of its ``top`` best layouts,
    split into weights, gradients, optimizer state, activations and the reserve, against the
    GPU's memory (the closest layout when none fits). Returns ``path``."""
    layouts = list(plan.layouts[:top]) if plan.layouts else ([plan.closest] if plan.closest is not None else [])
    if not layouts:
        raise ConfigError("the plan has no layout to draw")
    plt = _pyplot()
    gib = float(2**30)
    parts: list[tuple[str, str, Any]] = [
        ("weights", "tab:blue", lambda m: m.weights_bytes), ("gradients", "tab:orange", lambda m: m.gradients_bytes),
        ("optimizer state", "tab:green", lambda m: m.optimizer_bytes),
        ("activations", "tab:purple", lambda m: m.activations_bytes), ("reserve", "0.7", lambda m: m.reserve_bytes)]
    fig, ax = plt.subplots(figsize=(MIXTURE_SIZE[0], 1.6 + 0.55 * len(layouts)))
    labels = [f"#{k + 1} {layout.label()}  ({layout.iteration_s:.2f} s/iter)" for k, layout in enumerate(layouts)]
    rows = list(range(len(layouts)))[::-1]  # the best at the top
    for name, color, bytes_of in parts:
        left = [sum(f(layout.memory) for _, _, f in parts[:[p[0] for p in parts].index(name)]) / gib
                for layout in layouts]
        width = [bytes_of(layout.memory) / gib for layout in layouts]
        ax.barh(rows, width, left=left, color=color, label=name, height=0.6)
    capacity = layouts[0].memory_per_gpu_bytes / gib
    ax.axvline(capacity, color="tab:red", linewidth=1.5, label=f"GPU memory ({capacity:.0f} GiB)")
    for row, layout in zip(rows, layouts):
        ax.text(layout.memory.total_gib, row, f" {layout.memory.total_gib:.1f} GiB", va="center", fontsize=8)
    ax.set_yticks(rows, labels, fontsize=8)
    ax.set_xlabel("memory per GPU (GiB) of the most loaded pipeline stage")
    fits = "best layouts" if plan.layouts else "no layout fits; the closest"
    model = model_name or f"{plan.model.num_layers} layers x {plan.model.hidden_size}"
    ax.set_title(f"{model} on {plan.cluster.num_gpus} x {gpu_name or 'GPU'}: memory per GPU, {fits}")
    ax.set_xlim(0, max(capacity, max(layout.memory.total_gib for layout in layouts)) * 1.25)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


__all__ = ["plot_memory", "plot_mixture"]
