"""``lf-* plot RUN_DIR``: loss and throughput curves of a run, drawn to PNG."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.config import ConfigError
from loongforge.core.metrics import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``RUN_DIR/metrics.jsonl``'s curves to ``out`` (default ``RUN_DIR/curves.png``).
    Needs matplotlib (the ``loongforge-core[plot]`` extra); without it a ConfigError says so."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        raise ConfigError("plotting needs matplotlib, which is not installed: "
                          "pip install 'loongforge-core[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no records to plot")
    keys = [k for k in ("loss", "tokens_per_s", "samples_per_s", "grad_norm", "mfu") if any(k in r for r in records)]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts])
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
