"""``treespec tune``: learn an auto profile for a model/draft pair on sample prompts.

    profile, sizes = tune(model, drafter, prompts, max_new_tokens=128)
    profile.save("profile.json")
    save_tune_plots(profile, sizes, "plots/")

The pair generates with an ``auto`` tree on every prompt, one shared
:class:`~treespec.auto.AutoProfile` learning online (the calibration of the sampling mode
used, the draft time per level); the cost curve comes from the disk cache or is measured
first. The pictures: the cost curve, the calibration (fitted against the prior, with the
observations per bin) and the histogram of the tree sizes chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .auto import AutoProfile
from .config import TreeConfig
from .engine import generate

__all__ = ["tune", "TuneResult", "save_tune_plots"]


@dataclass
class TuneResult:
    profile: AutoProfile
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes verified, per request-step
    num_generated: int = 0
    seconds: float = 0.0
    accepted_length: list[float] = field(default_factory=list)  # tau per prompt


def tune(model, drafter, prompts: Sequence[Sequence[int]], tree: TreeConfig | str = "auto", *,
         seed: int | None = 0, profile: AutoProfile | None = None, refresh_costs: bool = False,
         callback: Callable[[int, int], None] | None = None, **options) -> TuneResult:
    """Run ``drafter`` with an auto ``tree`` on each prompt, learning into ``profile`` (a
    fresh one if None); ``callback(done, total)`` after each prompt. ``options`` are
    :func:`~treespec.generate`'s (``max_new_tokens``, 128 unless given; ``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``attention_backend``, ...); prompt ``i`` is sampled
    with seed ``seed + i``."""
    options.setdefault("max_new_tokens", 128)
    cfg = TreeConfig.preset(tree) if isinstance(tree, str) else tree
    if not cfg.auto:
        raise ValueError(f"tune needs an auto tree (e.g. 'auto' or TreeConfig.auto(...)), got {cfg.describe()}")
    profile = profile if profile is not None else AutoProfile()
    if refresh_costs:
        from .runner import ModelRunner

        runner = ModelRunner(model, options.get("attention_backend", "auto"))
        with runner.attached():
            profile.prepare(runner, cfg.max_tree_tokens + getattr(drafter, "extra_nodes", 0), refresh=True)
    result = TuneResult(profile)
    for i, p in enumerate(prompts):
        out = generate(model, drafter, cfg, list(p), seed=None if seed is None else seed + i, auto_profile=profile,
                       **options)
        m = out.metrics
        result.tree_sizes.extend(m.tree_sizes)
        result.num_generated += m.num_generated
        result.seconds += m.total_seconds
        result.accepted_length.append(m.mean_accepted_length)
        if callback:
            callback(i + 1, len(prompts))
    profile.keys["tree"] = cfg.describe()
    return result


def save_tune_plots(profile: AutoProfile, tree_sizes: Sequence[int], out_dir, prefix: str = "",
                    title: str = "") -> list[Path]:
    """Three PNGs: ``{prefix}cost_curve.png``, ``{prefix}calibration.png`` and
    ``{prefix}tree_sizes.png``. Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (("cost_curve", lambda: _cost_curve_figure(profile, title)),
                       ("calibration", lambda: _calibration_figure(profile, title)),
                       ("tree_sizes", lambda: _tree_sizes_figure(tree_sizes, title))):
        fig = draw()
        fig.set_layout_engine("tight")
        paths.append(out_dir / f"{prefix}{name}.png")
        fig.savefig(paths[-1], format="png", dpi=100)
    return paths


def _cost_curve_figure(profile: AutoProfile, title: str):
    """The measured verify forward per tree size, one decode step, the step as measured and
    one draft level, in ms."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    if profile.costs is not None:
        c = profile.costs
        ax.plot(c.tokens, [s * 1e3 for s in c.seconds], marker="o", label="verify forward")
        ax.axhline(c.seconds[0] * 1e3, color="#999999", lw=0.8, ls="--", label="one token (a decode step)")
        if profile.step_overhead:
            step = [s + profile.step_overhead + profile.step_slope * (q - 1) for q, s in zip(c.tokens, c.seconds)]
            ax.plot(c.tokens, [t * 1e3 for t in step], color="#5070b0", lw=0.8,
                    ls="-.", label="a step as measured (forward + the step's own cost, its slope included)")
    if profile.level_seconds:
        ax.axhline(profile.level_seconds * 1e3, color="#c07030", lw=0.8, ls=":", label="one draft level")
    ax.set_xlabel("tokens verified (tree nodes, root included)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    key = profile.keys.get("costs", {})
    ax.set_title(f"measured verify cost\n{title} {key.get('dtype', '')} {key.get('device', '')} "
                 f"{key.get('threads', '')} threads".strip(), fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def _calibration_figure(profile: AutoProfile, title: str):
    """Each calibration fitted against the prior, with the verified nodes per score bin."""
    import numpy as np
    from matplotlib.figure import Figure

    from .drafters.hybrid import SOURCE_NAMES

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    counts = ax.twinx()
    centres = profile.greedy.centres
    ax.plot(centres, profile.greedy.prior, color="#999999", ls="--", label="prior exp(score)")
    upper = np.array(profile.greedy.edges)
    lower = 2 * centres - upper  # each bar spans its bin
    own = "draft, " if profile.sources else ""  # the head's own nodes, beside a grafted lookup's
    curves = [(f"{own}greedy", profile.greedy), (f"{own}sampling", profile.sampling)]
    curves += [(f"{SOURCE_NAMES.get(k, k)}, {m}", c) for k, v in sorted(profile.sources.items()) for m, c in v.items()]
    for name, cal in curves:
        if cal.num_observed:
            line, = ax.plot(centres, cal.fitted(), marker="o", label=f"{name}: fitted ({cal.num_observed} nodes)")
            counts.bar(lower, cal.seen, width=upper - lower, align="edge", alpha=0.2, color=line.get_color())
    ax.set_xlabel("draft score (cumulative log-probability)")
    ax.set_ylabel("P(accepted)")
    ax.set_ylim(0, 1.02)
    counts.set_ylabel("verified nodes per bin")
    ax.set_title(f"calibration of draft scores\n{title}".strip(), fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def _tree_sizes_figure(tree_sizes: Sequence[int], title: str):
    """The histogram of the tree sizes chosen."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    sizes = list(tree_sizes)
    top = max(sizes, default=0)
    ax.hist(sizes, bins=range(0, top + 2), align="left", color="#4a6d8c")
    mean = sum(sizes) / max(len(sizes), 1)
    ax.set_xlabel("drafted nodes verified (0: the root alone)")
    ax.set_ylabel("request-steps")
    ax.set_title(f"tree sizes chosen (mean {mean:.1f}, {len(sizes)} steps)\n{title}".strip(), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return fig
