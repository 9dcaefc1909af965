"""The paper's figure: scaling factor against bandwidth, one line per compressor (or
compression ratio), one panel per cluster size. matplotlib with the Agg backend (no display).

    plot(sweep(trace, workers=[16, 32, 64], gbps=[1, 10, 25, 40, 100], ratios=[1, 2, 5]), "out.png")
"""


def plot(predictions, path, title=None):
    """Write a PNG of ``predictions`` (from :func:`~horovod_sparse.whatif.advise.sweep`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({p.workers for p in predictions})
    labels = list(dict.fromkeys(p.label for p in predictions))
    fig, axes = plt.subplots(1, len(workers), figsize=(4.2 * len(workers), 3.6), squeeze=False, sharey=True)
    for ax, w in zip(axes[0], workers):
        for label in labels:
            pts = sorted((p.gbps, p.scaling) for p in predictions if p.workers == w and p.label == label)
            if pts:
                ax.plot([g for g, _ in pts], [s for _, s in pts], marker="o", markersize=3, label=label)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{w} workers")
        ax.set_xlabel("bandwidth (Gbit/s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("scaling factor")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
