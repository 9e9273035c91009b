"""The one plotting module: scatter plots of policies (with CIs and the Pareto frontier) and
per-layer lines, written as PNGs a reader could put in a paper. matplotlib is imported
lazily (an optional dependency, `pip install expertcache[study]`)."""
from __future__ import annotations

from pathlib import Path

# A y range wider than this many times the spread of the bulk switches the axis to symlog,
# so one outlier (substitute-all's +171%) does not flatten every other point.
OUTLIER_SPREAD = 8.0


def require() -> None:
    """BadInput naming the fix where matplotlib is not installed: called before a run that ends in a plot, so that
    the run is not lost to it."""
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        from ..errors import BadInput
        raise BadInput("plots need matplotlib, which this install lacks: pip install 'expertcache[study]' (or leave "
                       "out --plot)")


def _pyplot():
    require()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 8, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _save(fig, path: Path) -> None:
    """The figure written whole or not at all: a full disk or a Ctrl-C mid-write cut the plot it replaced short.
    Its format is the path's suffix's (the temporary's name ends in .partial)."""
    from ..atomic import replaced
    with replaced(Path(path)) as tmp:
        fig.savefig(tmp, dpi=150, format=Path(path).suffix.lstrip(".").lower() or "png")


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Labels of the points no other point beats on both axes (lower is better on both), by x."""
    ordered = sorted(points, key=lambda k: (points[k][0], points[k][1]))
    front, best_y = [], float("inf")
    for label in ordered:
        if points[label][1] < best_y:
            front.append(label)
            best_y = points[label][1]
    return front


def _needs_symlog(ys: list[float]) -> bool:
    if len(ys) < 3:
        return False
    ordered = sorted(abs(y) for y in ys)
    bulk = ordered[len(ordered) // 2] or 1e-9
    return ordered[-1] > OUTLIER_SPREAD * bulk and ordered[-1] > 10


def _place_labels(ax, texts) -> None:
    """Labels moved off each other and off the points (adjustText when installed)."""
    try:
        from adjustText import adjust_text
    except ImportError:
        return
    adjust_text(texts, ax=ax, arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5})


def scatter(points: dict[str, tuple[float, float]], xlabel: str, ylabel: str, title: str, path: Path,
            errors: dict[str, tuple[float, float]] | None = None, frontier: bool = False,
            highlight: str | None = None, short: dict[str, str] | None = None,
            groups: dict[str, str] | None = None) -> Path:
    """One point per label at (x, y); errors: label -> (below, above) for error bars on y;
    frontier: draw the Pareto frontier (lower is better on both axes) as a line; highlight:
    a label drawn as a star (a chosen policy); short: display names for long labels; groups: label -> the
    group it belongs to (e.g. a cache size), each group in a colour of its own with a frontier of its own, since
    points of different groups (memory) do not compete."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    group_of = groups or dict.fromkeys(points, "")
    names = list(dict.fromkeys(group_of[label] for label in points))
    colour = {g: f"C{i}" if groups else "C0" for i, g in enumerate(names)}
    texts = []
    for label, (x, y) in points.items():
        yerr = [[errors[label][0]], [errors[label][1]]] if errors and label in errors else None
        star = label == highlight
        ax.errorbar(x, y, yerr=yerr, fmt="*" if star else "o", ms=11 if star else 4, capsize=2, lw=0.8,
                    color="C3" if star else colour[group_of[label]], zorder=3)
        texts.append(ax.text(x, y, (short or {}).get(label, label), fontsize=6))
    for g in names:
        members = {k: v for k, v in points.items() if group_of[k] == g}
        if frontier and len(members) > 1:
            front = pareto_front(members)
            ax.plot([members[k][0] for k in front], [members[k][1] for k in front], "-", lw=1, zorder=2,
                    color=colour[g] if groups else "C1", label=f"{g}: Pareto frontier" if groups else "Pareto frontier")
        elif groups:
            ax.plot([], [], "o", color=colour[g], label=g)
    if (frontier and len(points) > 1) or groups:
        ax.legend(loc="best", frameon=False)
    if _needs_symlog([y for _, y in points.values()]):
        ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, lw=0.5)
    _place_labels(ax, texts)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def lines(series: dict[str, list[float]], xticks: list[str], xlabel: str, ylabel: str, path: Path,
          title: str = "", percent: bool = False) -> Path:
    """One line per series over the same x positions (e.g. recall per layer transition); each series has a
    marker and dash of its own, so that two that coincide (a hybrid equal to the estimator) both show.
    percent: the values are fractions, labelled as percentages."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--"), ("X", "-.")]
    for i, (name, ys) in enumerate(series.items()):
        marker, dash = styles[i % len(styles)]
        ax.plot(range(len(ys)), ys, marker=marker, ls=dash, ms=4, lw=1, mfc="none" if i % 2 else None, label=name)
    ax.set_xticks(range(len(xticks)), xticks)
    if percent:
        from matplotlib.ticker import PercentFormatter
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, lw=0.5)
    ax.legend(frameon=False, loc="best")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path
