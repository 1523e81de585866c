"""A benchmark's figures as PNGs (:func:`save_plots`), drawn with matplotlib's object API
(no global pyplot state)."""

from __future__ import annotations

from pathlib import Path

from .configs import HF_GENERATE, PEER, TREESPEC


def save_plots(data: dict, out_dir, prefix: str = "") -> list[Path]:
    """PNGs from ``to_json``'s output: acceptance rate by draft position per treespec
    configuration (``{prefix}acceptance_by_position.png``), tokens/s per configuration as
    bars (``{prefix}tokens_per_second.png``; another engine's rows, benchmarks/peers/, in a
    colour of their own) and, where the prompts have categories (Spec-Bench), speedup per
    category as grouped bars (``{prefix}speedup_by_category.png``).
    Returns the paths written."""
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = [c for c in data["configs"] if not c.get("skipped")]
    title = f"{data.get('model', '')} {data.get('dataset', '')}, {data['settings']['num_prompts']} prompts, " \
            f"{data['settings']['max_new_tokens']} new tokens".strip()
    paths = []

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    spec = [c for c in configs if c.get("acceptance_rate_by_position")]
    for c in spec:
        acc = c["acceptance_rate_by_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{c['name']} (tau {c['mean_accepted_length']:.2f})")
    ax.set_xlabel("draft position d")
    ax.set_ylabel("share of steps accepting >= d drafts")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance rate by draft position\n" + title, fontsize=9)
    if spec:
        ax.legend(fontsize=7)
        ax.set_xticks(range(1, max(len(c["acceptance_rate_by_position"]) for c in spec) + 1))
    ax.grid(alpha=0.3)
    fig.set_layout_engine("tight")
    paths.append(out_dir / f"{prefix}acceptance_by_position.png")
    fig.savefig(paths[-1], format="png", dpi=100)

    fig = Figure(figsize=(max(6.4, 0.9 * len(configs) + 2), 4.0))
    ax = fig.add_subplot()
    names = [c["name"] for c in configs]
    tps = [c["tokens_per_second"] for c in configs]
    colors = [{TREESPEC: "#4a6d8c", PEER: "#c0813a"}.get(c["kind"], "#9aaabb") for c in configs]
    bars = ax.bar(range(len(names)), tps, color=colors)
    for b, c in zip(bars, configs):
        if c.get("speedup") is not None:
            ax.annotate(f"{c['speedup']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.15 * max(tps, default=0) or 1)  # headroom: the speedup labels sit above the bars
    ax.set_ylabel("tokens/s (total tokens / total seconds)")
    ax.set_title("throughput, speedup over HF generate\n" + title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.set_layout_engine("tight")
    paths.append(out_dir / f"{prefix}tokens_per_second.png")
    fig.savefig(paths[-1], format="png", dpi=100)
    if data.get("categories"):
        paths.append(out_dir / f"{prefix}speedup_by_category.png")
        _category_plot(data, configs, title).savefig(paths[-1], format="png", dpi=100, bbox_inches="tight")
    return paths


def _category_plot(data: dict, configs: list[dict], title: str):
    """Spec-Bench's view: per category (and overall) a group of bars, one per configuration,
    the speedup over HF generate (a line at 1)."""
    from matplotlib.figure import Figure

    groups = list(data["categories"]) + ["overall"]
    shown = [c for c in configs if c["name"] != HF_GENERATE]
    fig = Figure(figsize=(min(max(7.0, 0.2 * len(groups) * (len(shown) + 1) + 2), 12.0), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / max(len(shown), 1)
    for k, c in enumerate(shown):
        ys = [c["categories"][g]["speedup"] if g != "overall" else c.get("overall_speedup") for g in groups]
        xs = [j + (k - (len(shown) - 1) / 2) * width for j in range(len(groups))]
        bars = ax.bar(xs, [y or 0 for y in ys], width, label=c["name"])
        if len(shown) <= 4:  # values readable above the bars only when the groups are narrow
            for b, y in zip(bars, ys):
                if y is not None:
                    ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                                va="bottom", fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"{HF_GENERATE} (1x)")
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    top = max([c.get("overall_speedup") or 0 for c in shown]
              + [v["speedup"] or 0 for c in shown for v in c["categories"].values()] + [1.0])
    ax.set_ylim(0, 1.15 * top)
    ax.set_ylabel(f"speedup over {HF_GENERATE}")
    ax.set_title("speedup by Spec-Bench category (overall: their mean)\n" + title, fontsize=9)
    ax.legend(fontsize=7, ncol=min(len(shown) + 1, 3), loc="upper center", bbox_to_anchor=(0.5, -0.08),
              frameon=False)  # below the axes: never over a bar
    ax.grid(axis="y", alpha=0.3)
    fig.set_layout_engine("tight")
    return fig
