"""Pictures: ``tokenloom audit LOG --plot`` and ``tokenloom plan ... --plot`` write PNGs of the
expected size (weight changes and skips drawn), and say what to install without matplotlib."""

from __future__ import annotations

import builtins
import struct

import pytest

from serve_fixtures import write_corpus
from tokenloom.cli import main as cli_main
from tokenloom.errors import ConfigError
from tokenloom.serve import BatchGeometry, MixtureAudit, RankLoader, read_audit_log
from tokenloom.source import StoreBlendSource

pytest.importorskip("matplotlib")


def _png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(32)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory):
    """A log of 30 steps of a 3-dataset blend, weights changed at step 12 and steps skipped at 20."""
    root = tmp_path_factory.mktemp("plots")
    prefixes = write_corpus(root, 3, seed=2)
    source = StoreBlendSource.from_prefixes(prefixes, [0.5, 0.3, 0.2], num_samples=2000, seq_length=16, seed=3)
    loader = RankLoader(source, BatchGeometry(global_batch_size=16, micro_batch_size=4, dp=1),
                        audit=MixtureAudit(root / "audit.jsonl"), max_steps=30)
    for step in range(30):
        if step == 12:
            loader.reweight([0.2, 0.2, 0.6])
        if step == 20:
            loader.skip_steps(20, 23)
        for _ in range(4):
            loader.next_batch()
    return root / "audit.jsonl"


def test_the_mixture_picture(audit_log, tmp_path, capsys):
    log = read_audit_log(audit_log)
    assert any(r.get("skipped") for r in log.records)
    out = tmp_path / "mixture.png"
    assert cli_main(["audit", str(audit_log), "--plot", str(out)]) == 0
    assert f"wrote the mixture plot to {out}" in capsys.readouterr().err
    assert _png_size(out) == (1100, 550)
    assert out.stat().st_size > 20_000  # lines, labels and a legend, not an empty canvas


def test_every_target_line_is_drawn_above_its_realised_line_and_steps_are_whole(tmp_path, monkeypatch):
    """A blend that follows its weights exactly puts each target on its realised line: the target
    is drawn on top, dashed, so it shows; 3 steps get integer ticks, not 0.25-steps."""
    import tokenloom.plots as plots

    prefixes = write_corpus(tmp_path, 2, seed=4)
    source = StoreBlendSource.from_prefixes(prefixes, [0.5, 0.5], num_samples=200, seq_length=16, seed=3)
    path = tmp_path / "short.jsonl"
    loader = RankLoader(source, BatchGeometry(global_batch_size=8, micro_batch_size=8, dp=1),
                        audit=MixtureAudit(path), max_steps=3)
    for _ in loader:
        pass
    kept = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: (kept.append(fig), fig.canvas.draw(), out)[-1])
    plots.plot_mixture(read_audit_log(path), str(tmp_path / "short.png"))
    ax = kept[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    names = {label.rsplit(": ", 1)[0] for label in lines if label.endswith(": target")}
    assert len(names) == 2
    for name in names:
        realised, target = lines[f"{name}: realised"], lines[f"{name}: target"]
        assert target.get_zorder() > realised.get_zorder() and target.get_linestyle() != "-"
        assert realised.get_linewidth() > target.get_linewidth()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_the_memory_picture(tmp_path, capsys):
    out = tmp_path / "memory.png"
    code = cli_main(["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--num-gpus", "256",
                     "--global-batch-tokens", "4194304", "--train-tokens", "2e12", "--top", "4", "--plot", str(out)])
    assert code == 0
    assert f"wrote the memory plot to {out}" in capsys.readouterr().err
    width, height = _png_size(out)
    assert width == 1100 and height == int((1.6 + 0.55 * 4) * 100)
    small = tmp_path / "none-fits.png"  # nothing fits: the closest layout is drawn
    code = cli_main(["plan", "--model", "llama2-70b", "--gpu", "h100-80gb", "--num-gpus", "8",
                     "--global-batch-tokens", "4194304", "--train-tokens", "2e12", "--plot", str(small)])
    assert code == 1 and _png_size(small)[0] == 1100


def test_without_matplotlib_the_message_says_what_to_install(audit_log, tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert cli_main(["audit", str(audit_log), "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'tokenloom[plot]'" in capsys.readouterr().err
    from tokenloom.plots import plot_mixture

    with pytest.raises(ConfigError, match="needs matplotlib"):
        plot_mixture(read_audit_log(audit_log), str(tmp_path / "y.png"))
    assert not (tmp_path / "x.png").exists()
