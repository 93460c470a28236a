"""The picture that explains continuous batching: one row per batch slot, one bar per request.

Static batching shows waves: every slot waits (grey) at the barrier until the wave's longest request is done.
Continuous batching refills a slot the moment its request finishes. All panels share one time axis.
"""

from __future__ import annotations

from pathlib import Path

from bench.results import SystemRun, assign_slots

# tab20 without its two greys, which are kept for idle slots.
_PALETTE = [i for i in range(20) if i not in (14, 15)]


def plot_timelines(runs: list[SystemRun], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    runs = [run for run in runs if run.traces]  # a system that reports no per-request times has no timeline
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 5), sharex=True, squeeze=False)
    cmap = plt.get_cmap("tab20")
    end = max(run.wall_seconds for run in runs)
    for ax, run in zip(axes[0], runs, strict=True):
        slots = max(t.slot for t in run.traces) + 1 if run.system == "static" else assign_slots(run.traces)
        for trace in run.traces:
            ax.barh(
                trace.slot,
                trace.finished - trace.admitted,
                left=trace.admitted,
                height=0.8,
                color=cmap(_PALETTE[trace.index % len(_PALETTE)]),
                edgecolor="black",
                linewidth=0.3,
            )
            if trace.released > trace.finished:
                ax.barh(
                    trace.slot,
                    trace.released - trace.finished,
                    left=trace.finished,
                    height=0.8,
                    color="lightgrey",
                    hatch="//",
                    edgecolor="grey",
                    linewidth=0.3,
                )
        for barrier in sorted({t.released for t in run.traces}) if run.system == "static" else []:
            ax.axvline(barrier, color="red", linestyle="--", linewidth=1)
        ax.set_title(f"{run.system}: {run.wall_seconds:.2f} s, {run.tokens_per_second:,.0f} tok/s")
        ax.set_xlabel("seconds")
        ax.set_ylabel("batch slot")
        ax.set_ylim(slots - 0.5, -0.5)
        ax.set_xlim(0, end * 1.02)
    legend = [
        Patch(facecolor=cmap(0), edgecolor="black", label="request: admitted -> last token"),
        Patch(facecolor="lightgrey", hatch="//", edgecolor="grey", label="slot idle until the wave barrier"),
        Line2D([0], [0], color="red", linestyle="--", label="wave barrier"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
