"""`kiln plot RUN... --out PNG`: training loss (smoothed), eval loss and learning rate of one or
more runs in one picture, from their metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from kiln.errors import KilnError
from kiln.tracking.jsonl import read_metrics, series


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last = weight * last + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(last / norm)
    return out


def plot_runs(runs: list[str | Path], out: str | Path, smoothing: float = 0.8) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    loaded = []
    for run in runs:
        records = read_metrics(run)
        if not records:
            raise KilnError(f"{run} has no metrics.jsonl (or it is empty): not a kiln run directory")
        loaded.append((Path(run).name or str(run), records))
    fig, (ax_loss, ax_eval, ax_lr) = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, records) in enumerate(loaded):
        color = colors[i % len(colors)]
        steps, loss = series(records, "loss")
        if steps:
            ax_loss.plot(steps, loss, color=color, alpha=0.25, linewidth=1)
            ax_loss.plot(steps, ema(loss, smoothing), color=color, label=name, linewidth=2)
        steps, val = series(records, "val_loss")
        if steps:
            ax_eval.plot(steps, val, color=color, marker="o", markersize=4, label=name)
        steps, lr = series(records, "lr")
        if steps:
            ax_lr.plot(steps, lr, color=color, label=name)
    for ax, title, ylabel in ((ax_loss, f"Training loss (EMA {smoothing:g}; raw faint)", "loss"),
                              (ax_eval, "Validation loss", "val_loss"),
                              (ax_lr, "Learning rate", "lr")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    fig.suptitle(", ".join(name for name, _ in loaded))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
