"""From measured per-rank work to a cluster-scale critical path (issue 12's projection).

The ranks table (``ranks.py``) measures, for N = 1, 2, 4, 8, 16 ranks, each rank's CPU seconds
of the build call on the benchmark corpus. The largest rank's CPU fits

    cpu_largest(N) = a + b / N                                         (1)

where ``a`` is the work every rank repeats whatever N is (fingerprinting the stores and making
their dataset items divide; gathering those, planning the blends, opening the result, the
collectives and loading the compiled kernels do not) and ``b`` the work that divides (dataset
indices, the blends, writing and hashing the arrays). ``a`` and ``b`` come from a least-squares fit
of (1) to the measured points, with ``a`` held at least at what the largest run shows beyond an
even share of the one-rank work, ``cpu_largest(N_max) - cpu(1) / N_max`` (then ``b`` is fitted
again with that ``a``). A one-rank run that costs more than two ranks together (the stateless
build can) would otherwise give a negative ``a``.

At a target scale of ``tokens`` tokens over ``datasets`` datasets, every divisible part of the
exact build grows with the tokens (document positions, blend samples, array bytes) at a fixed
number of datasets, so

    critical_path(R) = a(datasets) + b * (tokens / corpus_tokens) / R      (2)

with ``a(datasets) = a * datasets / corpus_datasets`` when planning and opening grow with the
datasets (an upper bound: part of ``a`` divides over ranks), or, where it was measured, the
largest rank's CPU seconds of a start at ``datasets`` stores on 16 ranks that takes the general
path (``warm.py``'s ``verify_stores=hash`` rows: every store hashed, every item made, gathered and
planned, as a cold build does; a start from a warm-start record skips that work; ``fixed_s``),
plus the largest
single item that cannot be divided (one store's dataset index: ``positions of the largest store
x seconds per position``), which (2) assumes is below ``b * scale / R``; the function checks it.
"""

from __future__ import annotations


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b / n`` through ``(n, y)`` points, ``a`` at least
    ``y(n_max) - y(1) / n_max`` (and at least 0) where the points include ``n = 1``."""
    xs = [1.0 / n for n, _ in points]
    ys = [y for _, y in points]
    k = len(points)
    mean_x, mean_y = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return ys[0], 0.0
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    a = mean_y - b * mean_x
    by_ranks = dict(points)
    n_max = max(by_ranks)
    floor = max(0.0, by_ranks[n_max] - by_ranks[1] / n_max) if 1 in by_ranks else 0.0
    if a < floor:  # b again, by least squares with a held at the floor
        a = floor
        b = sum(x * (y - a) for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, b


def project(rows: list[dict], *, mode: str, corpus_tokens: float, corpus_datasets: int, tokens: float,
            datasets: int, ranks: int, largest_item_s: float = 0.0, fixed_s: float | None = None) -> dict:
    """Critical path at ``tokens`` x ``datasets`` on ``ranks`` ranks from the rows of ``mode``
    (``fixed_s``: a measured per-rank fixed cost at ``datasets`` instead of ``a`` scaled)."""
    points = [(r["ranks"], r["largest_cpu_s"]) for r in rows if r["mode"] == mode]
    a, b = fit(points)
    scale = tokens / corpus_tokens
    fixed = a * max(1.0, datasets / corpus_datasets) if fixed_s is None else max(a, fixed_s)
    divided = b * scale / ranks
    item = largest_item_s * scale
    return {"mode": mode, "a_s": a, "b_s": b, "tokens": tokens, "datasets": datasets, "ranks": ranks,
            "fixed_s": fixed, "divided_s": divided, "largest_item_s": item,
            "critical_path_s": fixed + max(divided, item), "points": points,
            "fixed_from": "scaled" if fixed_s is None else "measured, general-path start"}


def format_projection(projections: list[dict]) -> str:
    lines = ["| mode | tokens | datasets | ranks | fit: a (per rank) s | fit: b (divisible) s | a(datasets) s "
             "| b x scale / ranks s | largest item s | critical path s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in projections:
        lines.append(f"| {p['mode']} | {p['tokens']:.0e} | {p['datasets']:,} | {p['ranks']:,} | {p['a_s']:.2f} | "
                     f"{p['b_s']:.1f} | {p['fixed_s']:.2f} ({p.get('fixed_from', 'scaled')}) | {p['divided_s']:.2f} | "
                     f"{p['largest_item_s']:.2f} | "
                     f"{p['critical_path_s']:.1f} |")
    return "\n".join(lines)


__all__ = ["fit", "format_projection", "project"]
