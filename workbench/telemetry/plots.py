"""PNG plots of a run (matplotlib, Agg: no display needed), for report.md and the trackers.

    plots.run_plots(rows, evals, run_dir / "plots")     # -> [(title, path), ...]
    plots.overlay(runs, path)                           # several runs' curves in one figure
    plots.side_by_side(panels, path)                    # one small loss panel per run (a sweep)

`rows` are metrics.jsonl's rows. The standard curves are train loss (with eval loss when an
evaluation reports one), learning rate, grad norm, tokens/s (with MFU); every other numeric key a
method logs
goes into `method.png`, a panel per key prefix: DPO `rewards/*`, `logps/*`; GRPO reward
mean/std, completion length, clipping; whatever a new method adds. Mixture shares and bookkeeping are left out.
"""

from __future__ import annotations

from pathlib import Path

STANDARD = {"step", "time", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_seconds", "mfu", "flops",
            "usd_per_mtok", "target_tokens"}
SKIP_PREFIXES = ("mix/", "pack/")


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window, never a display server
    import matplotlib.pyplot as plt

    return plt


def _steps():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)  # steps are whole numbers


def _margins(fig, right: float = 0.2) -> None:
    """Fixed margins in inches (room for tick labels, axis labels and titles). tight_layout would
    measure every text box first: about 0.25 s a figure on a CPU, most of a short run's report."""
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=0.9 / w, right=1 - right / w, bottom=0.55 / h, top=1 - 0.4 / h, hspace=0.65, wspace=0.35)


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:  # NaN dropped
            xs.append(r.get("step", len(xs) + 1))
            ys.append(float(v))
    return xs, ys


def method_keys(rows: list[dict]) -> dict[str, list[str]]:
    """prefix -> numeric keys a method logged beyond the standard ones."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        for k, v in r.items():
            if (k in STANDARD or k.startswith(SKIP_PREFIXES) or isinstance(v, bool)
                    or not isinstance(v, (int, float))):
                continue
            # `rewards/chosen` -> rewards; `completion_length_max` -> completion
            prefix = k.split("/")[0] if "/" in k else k.split("_")[0]
            if k not in groups.setdefault(prefix, []):
                groups[prefix].append(k)
    return groups


def eval_series(evals: list[dict]) -> dict[str, tuple[list, list]]:
    """key -> (steps, values) for every numeric eval result over the run (eval_seconds dropped)."""
    out: dict[str, tuple[list, list]] = {}
    for e in evals:
        for k, v in e.items():
            if (k in ("step", "eval_seconds") or k.endswith(("/n", "/seconds")) or isinstance(v, bool)
                    or not isinstance(v, (int, float))):
                continue
            xs, ys = out.setdefault(k, ([], []))
            xs.append(e["step"])
            ys.append(float(v))
    return out


def run_plots(rows: list[dict], evals: list[dict], out_dir: Path) -> list[tuple[str, Path]]:
    """Write the run's figures into `out_dir`; return (title, path) for each."""
    rows = [r for r in rows if "eval" not in r]  # eval rows of metrics.jsonl come in via `evals`
    if not rows:
        return []
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ev = eval_series(evals)
    made: list[tuple[str, Path]] = []

    def figure(name: str, title: str, curves: list[tuple[str, list, list]], ylabel: str = "", logy: bool = False,
               twin: tuple[str, list, list] | None = None):
        curves = [c for c in curves if c[1]]
        if not curves:
            return
        fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
        for label, xs, ys in curves:
            ax.plot(xs, ys, marker="o" if len(xs) < 3 else None, label=label)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))  # short ticks fit the fixed margin
        if logy and all(y > 0 for _, _, ys in curves for y in ys):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(_steps())
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if twin and twin[1]:
            ax2 = ax.twinx()
            ax2.plot(twin[1], twin[2], color="tab:red", alpha=0.6, label=twin[0])
            ax2.set_ylabel(twin[0])
            ax2.legend(loc="lower right", fontsize=8)
        if len(curves) > 1:
            ax.legend(fontsize=8)
        _margins(fig, right=0.9 if twin and twin[1] else 0.2)
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        made.append((title, path))

    loss_curves = [("train", *_series(rows, "loss"))]
    loss_curves += [(f"eval {k}", *ev[k]) for k in ev if k.endswith("loss")]
    figure("loss", "loss", loss_curves, "loss")
    accs = [(k, *ev[k]) for k in ev if not k.endswith("loss")]
    figure("eval", "evaluation", accs, "")
    figure("lr", "learning rate", [("lr", *_series(rows, "lr"))], "lr")
    figure("grad_norm", "grad norm (before clipping)", [("grad_norm", *_series(rows, "grad_norm"))], "", logy=True)
    mfu = _series(rows, "mfu")
    figure("throughput", "throughput", [("tokens/s", *_series(rows, "tokens_per_s"))], "tokens/s",
           twin=("MFU", mfu[0], mfu[1]) if mfu[0] else None)
    groups = method_keys(rows)
    if groups:
        made.append(("method metrics", _panels(plt, rows, groups, out_dir / "method.png")))
    return made


def _panels(plt, rows: list[dict], groups: dict[str, list[str]], path: Path) -> Path:
    """One figure, a small panel per group of the method's keys (DPO rewards/logps, GRPO reward,
    completion length, clipping, ...), so a method with many metrics still gets one image."""
    cols = min(3, len(groups))
    nrows = -(-len(groups) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), dpi=100, squeeze=False)
    for ax, (prefix, keys) in zip(axes.flat, groups.items(), strict=False):
        for k in keys:
            ax.plot(*_series(rows, k), label=k)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        ax.set_title(prefix, fontsize=10)
        ax.xaxis.set_major_locator(_steps())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    _margins(fig)
    fig.savefig(path)
    plt.close(fig)
    return path


def overlay(runs: list[tuple[str, list[dict]]], path: Path, keys=("loss", "tokens_per_s")) -> Path | None:
    """One figure, a panel per key, a line per run (the multi-run comparison)."""
    runs = [(name, rows) for name, rows in runs if rows]
    if not runs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), dpi=100, squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for name, rows in runs:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, label=name)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(_steps())
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    _margins(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def side_by_side(panels: list[tuple[str, list[dict], bool, str]], path: Path, key: str = "loss") -> Path:
    """One small panel per run, four to a row, on a shared y axis, from (title, rows, highlighted,
    note): a highlighted run's curve is red, a run without rows shows its note instead (the
    sweep's loss_curves.png)."""
    import math

    plt = _plt()
    n = len(panels)
    cols = min(n, 4)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.8 * nrows), sharey=True, squeeze=False)
    for ax, (title, rows, highlighted, note) in zip(axes.flat, panels):
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, color="tab:red" if highlighted else "tab:blue", linewidth=1.5)
        else:
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
        ax.xaxis.set_major_locator(_steps())
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    for row in axes:
        row[0].set_ylabel(f"train {key}", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
