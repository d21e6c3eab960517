"""The PNG plots of ``orch report`` (matplotlib, Agg backend: no display needed).

Each function draws one figure from plain data and writes it to ``path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

# Marker styles on the timeline, by kind (see report.MARKER_EVENTS).
MARKER_STYLE = {
    "checkpoint": {"color": "tab:green", "linestyle": ":", "linewidth": 0.8},
    "preemption": {"color": "tab:red", "linestyle": "--", "linewidth": 1.4},
    "node lost": {"color": "tab:orange", "linestyle": "-", "linewidth": 1.4},
    "restart": {"color": "tab:purple", "linestyle": "-.", "linewidth": 1.0},
}
BADPUT_COLORS = ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:gray", "tab:olive", "tab:pink", "tab:cyan")
PHASE_COLORS = {"data": "tab:gray", "compute": "tab:blue", "comm": "tab:red", "optimizer": "tab:orange",
                "checkpoint": "tab:green", "other": "tab:olive"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def plot_timeline(metrics: list[dict[str, Any]], markers: list[dict[str, Any]], world_sizes: list[tuple[float, int]],
                  t0: float, path: Path, recoveries: Sequence[dict[str, Any]] = (),
                  gaps: Sequence[tuple[float, float, str]] = ()) -> Path:
    """Loss, raw and smoothed (top), and samples/s with the world size (bottom) against seconds since launch.
    ``gaps`` (``(start_t, end_t, cause)``: the time between attempts, goodput's) are shaded and named, each
    recovery (``{"lost_t", "recovered_t"}``) too; ``markers`` (``{"t", "kind", "label"}``) are vertical lines,
    except checkpoints, which are ticks along the bottom (dozens of lines would make a band); ``world_sizes`` is
    ``[(t, world_size), ...]`` in time order. Lines break between attempts; the legend sits outside the axes."""
    from orchestrator.report.efficiency import segments

    plt = _pyplot()
    fig, (ax_loss, ax_tput) = plt.subplots(2, 1, sharex=True, figsize=(11, 6))
    x = [m["t"] - t0 for m in metrics]
    for i, seg in enumerate(segments(metrics)):
        seg_x = [m["t"] - t0 for m in seg]
        losses = [m["loss"] if m.get("loss") is not None else float("nan") for m in seg]
        ax_loss.plot(seg_x, losses, color="tab:blue", alpha=0.3, label="loss" if i == 0 else None)
        ax_loss.plot(seg_x, smoothed(losses), color="tab:blue", label="loss (smoothed)" if i == 0 else None)
        ax_tput.plot(seg_x, [m.get("samples_per_s") or float("nan") for m in seg], marker=".", color="tab:cyan")
    ax_loss.set_ylabel("loss")
    for i, (start, end, cause) in enumerate(gaps):
        for ax in (ax_loss, ax_tput):
            ax.axvspan(start - t0, end - t0, color="tab:gray", alpha=0.15,
                       label="between attempts" if ax is ax_loss and i == 0 else None)
        ax_loss.annotate(cause, ((start + end) / 2 - t0, 1), xycoords=("data", "axes fraction"), ha="center",
                         va="bottom", fontsize="small", color="dimgray")
    for i, r in enumerate(recoveries):
        for ax in (ax_loss, ax_tput):
            ax.axvspan(r["lost_t"] - t0, r["recovered_t"] - t0, color="tab:orange", alpha=0.12,
                       label="recovery" if ax is ax_loss and i == 0 else None)
    ax_tput.set_ylabel("samples/s")
    ax_tput.set_xlabel("seconds since launch")
    ax_tput.set_xlim(left=0)
    if world_sizes:
        ax_ws = ax_tput.twinx()
        end = max([*x, *(m["t"] - t0 for m in markers), world_sizes[-1][0] - t0]) if x or markers else 0.0
        ax_ws.step([t - t0 for t, _ in world_sizes] + [end], [w for _, w in world_sizes] + [world_sizes[-1][1]],
                   where="post", color="black", alpha=0.5, label="world size")
        ax_ws.set_ylabel("world size")
        ax_ws.set_ylim(0, max(w for _, w in world_sizes) + 1)
        ax_ws.yaxis.get_major_locator().set_params(integer=True)
    seen: set[str] = set()
    for m in markers:
        style = MARKER_STYLE.get(m["kind"], {"color": "black", "linestyle": "-"})
        label = m["kind"] if m["kind"] not in seen else None
        if m["kind"] == "checkpoint":
            for ax in (ax_loss, ax_tput):
                ax.axvline(m["t"] - t0, ymax=0.04, color=style["color"], linewidth=1.0,
                           label=label if ax is ax_loss else None)
        else:
            for ax in (ax_loss, ax_tput):
                ax.axvline(m["t"] - t0, **style, label=label if ax is ax_loss else None)
        seen.add(m["kind"])
    ax_loss.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax_loss.set_title("loss and throughput over time")
    return _save(fig, path)


def smoothed(values: Sequence[float], weight: float = 0.8) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first points are not pulled to 0."""
    out, average, norm = [], 0.0, 0.0
    for v in values:
        average, norm = weight * average + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(average / norm)
    return out


def plot_loss_by_step(metrics: list[dict[str, Any]], path: Path) -> Path:
    """Loss against the optimizer step, raw and smoothed (:func:`smoothed`): the training curve, whatever the
    wall time lost around it. World-size changes and restarts (a new attempt) are marked where they happened, as
    steps; checkpoints are left out (one line each would make a band)."""
    from orchestrator.report.efficiency import segments

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    records = sorted((m for m in metrics if m.get("loss") is not None), key=lambda m: m["t"])
    ax.plot([m["step"] for m in records], [m["loss"] for m in records], color="tab:blue", alpha=0.3, label="loss")
    ax.plot([m["step"] for m in records], smoothed([m["loss"] for m in records]), color="tab:blue",
            label="loss (smoothed)")
    style = MARKER_STYLE["restart"]
    for i, seg in enumerate(segments(records)[1:]):  # a new attempt or world size: where its records begin
        first = seg[0]
        ax.axvline(first["step"], **style, label="restart or world size change" if i == 0 else None)
        ax.annotate(f"world size {first['world_size']}", (first["step"], 1), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize="small", color=style["color"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(loc="best", fontsize="small")
    ax.set_title("loss by step")
    return _save(fig, path)


def plot_step_breakdown(breakdowns: dict[int, dict[str, float]], path: Path) -> Path:
    """One stacked bar per world size: milliseconds per step in each phase."""
    plt = _pyplot()
    sizes = sorted(breakdowns)
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.7 * len(sizes)))
    left = [0.0] * len(sizes)
    for phase, color in PHASE_COLORS.items():
        widths = [1e3 * breakdowns[s].get(f"{phase}_s", 0.0) for s in sizes]
        ax.barh([f"world {s}" for s in sizes], widths, left=left, color=color, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("ms per step")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    ax.set_title("where each step's time goes")
    return _save(fig, path)


def plot_scaling(rows: list[dict[str, Any]], path: Path) -> Path:
    """Measured samples/s against world size, with linear scaling from the baseline for comparison."""
    plt = _pyplot()
    rows = sorted(rows, key=lambda r: r["world_size"])
    sizes = [r["world_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(sizes, [r["samples_per_s"] for r in rows], marker="o", label="measured")
    base = rows[0]
    ax.plot(sizes, [base["samples_per_s"] * s / base["world_size"] for s in sizes], linestyle="--", color="gray",
            label="linear scaling")
    for r in rows:
        if r.get("efficiency") is not None:
            ax.annotate(f"{r['efficiency']:.2f}", (r["world_size"], r["samples_per_s"]), textcoords="offset points",
                        xytext=(0, 8), ha="center", fontsize="small")
    ax.set_xlabel("world size")
    ax.set_ylabel("samples/s")
    ax.set_xticks(sizes)
    ax.legend()
    ax.set_title("throughput against world size (labels: scaling efficiency)")
    return _save(fig, path)


def plot_goodput(goodput: dict[str, Any], path: Path) -> Path:
    """One horizontal stacked bar: productive seconds, then each badput category."""
    plt = _pyplot()
    parts = [("productive", goodput.get("productive_s", 0.0))]
    parts += [(k.removesuffix("_s"), v) for k, v in (goodput.get("badput") or {}).items() if v]
    fig, ax = plt.subplots(figsize=(10, 2.6))
    left = 0.0
    for i, (name, seconds) in enumerate(parts):
        ax.barh(["wall time"], [seconds], left=left, label=f"{name} {seconds:.1f} s",
                color="tab:green" if i == 0 else BADPUT_COLORS[(i - 1) % len(BADPUT_COLORS)])
        left += seconds
    ax.set_xlabel("seconds")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    ax.set_title(f"goodput {goodput.get('goodput', 0.0):.1%}")
    return _save(fig, path)
