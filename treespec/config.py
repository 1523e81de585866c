"""Tree configurations: which shape of tree to draft, and the named presets.

A ``TreeConfig`` is either *dynamic* (EAGLE-2: the shape is chosen per step from draft
scores) or *static* (a fixed shape, given as Medusa / vLLM path lists; a chain is the
simplest static tree).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

from .tree import Tree

__all__ = ["TreeConfig", "PRESETS", "Preset"]


@dataclass(frozen=True)
class TreeConfig:
    """How to shape each step's draft tree.

    Dynamic (EAGLE-2) fields:
        depth:     maximum depth of a drafted node (the root is depth 0). EAGLE's
                   ``depth=d`` argument corresponds to ``depth=d+1`` here, SGLang's
                   ``num_steps`` to ``depth``.
        top_k:     candidates expanded per frontier node and frontier width per level.
        num_nodes: drafted nodes kept after the rerank (root excluded): the verify
                   forward runs ``num_nodes + 1`` tokens. EAGLE's ``total_token`` and
                   SGLang's ``num_draft_tokens`` count the root: they are ``num_nodes + 1``.
    Static fields:
        paths:     the tree as Medusa / vLLM child-rank paths, breadth-first.
    Auto (``TreeConfig.auto(...)``, ``auto=True``, dynamic only): depth, top_k and
        num_nodes are maxima; each step verifies the part of the drafted tree that maximises
        expected tokens per second (:mod:`treespec.auto`).
        objective: ``"step"`` (each step's own expected rate) or ``"rate"`` (the
                   generation's: a node pays when its probability beats the rate achieved
                   so far times its cost).
    """

    kind: str
    depth: int
    top_k: int
    num_nodes: int
    paths: tuple[tuple[int, ...], ...] | None = None
    auto: bool = False  # size each step's tree by cost (treespec.auto); the constructor is set below
    objective: str = "step"  # auto only: what the size maximises (treespec.auto)

    def __post_init__(self):
        if self.kind not in ("dynamic", "static"):
            raise ValueError(f"kind must be 'dynamic' or 'static', got {self.kind!r}")
        for name in ("depth", "top_k", "num_nodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an int, got {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.kind == "dynamic":
            pool = self.top_k + (self.depth - 1) * self.top_k * self.top_k
            if self.num_nodes > pool:
                raise ValueError(
                    f"num_nodes={self.num_nodes} exceeds the candidate pool of a dynamic tree "
                    f"with depth={self.depth}, top_k={self.top_k} ({pool} = top_k + "
                    f"(depth-1)*top_k^2): lower num_nodes or raise depth/top_k"
                )
        elif self.paths is None:
            raise ValueError("a static TreeConfig needs paths")
        if not isinstance(self.auto, bool):
            raise ValueError(f"auto must be a bool, got {self.auto!r}")
        if self.auto and self.kind != "dynamic":
            raise ValueError("auto sizing needs a dynamic TreeConfig: a static shape has nothing to choose")
        if self.objective not in ("step", "rate"):
            raise ValueError(f"objective must be 'step' or 'rate', got {self.objective!r}")
        if self.objective != "step" and not self.auto:
            raise ValueError("objective applies to auto trees only (TreeConfig.auto(..., objective=...))")

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def dynamic(cls, depth: int, top_k: int, num_nodes: int) -> "TreeConfig":
        """An EAGLE-2 dynamic tree: expand ``top_k`` per level for ``depth`` levels, keep
        the ``num_nodes`` drafted nodes of highest cumulative draft log-probability."""
        return cls("dynamic", depth, top_k, num_nodes)

    @classmethod
    def static(cls, paths: Sequence[Sequence[int]]) -> "TreeConfig":
        """A fixed tree given as child-rank paths (``[[0], [1], [0, 0]]``)."""
        tree = Tree.from_paths(paths)  # validates
        canon = tuple(tuple(p) for p in sorted(tree.to_paths(), key=lambda p: (len(p), p)))
        width = 1 + max(max(p) for p in canon) if canon else 1
        return cls("static", tree.max_depth, width, tree.num_drafted, canon)

    @classmethod
    def chain(cls, k: int) -> "TreeConfig":
        """A chain of ``k`` drafted tokens (classic speculative decoding)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"a chain needs k >= 1 drafted tokens, got {k!r}")
        return cls.static([[0] * d for d in range(1, k + 1)])

    @classmethod
    def from_medusa_choices(cls, choices) -> "TreeConfig":
        """Read Medusa's ``medusa_choices`` (a list of tuples or lists, or its repr)."""
        if isinstance(choices, str):
            try:
                choices = ast.literal_eval(choices)
            except (ValueError, SyntaxError) as e:
                raise ValueError(f"cannot parse Medusa choices {choices[:60]!r}: {e}") from None
        return cls.static([list(c) for c in choices])

    from_vllm = from_medusa_choices  # vLLM's speculative_token_tree uses the same format

    @classmethod
    def preset(cls, name: str) -> "TreeConfig":
        try:
            return PRESETS[name].config
        except KeyError:
            raise ValueError(
                f"unknown tree preset {name!r}; known presets: {', '.join(PRESETS)}"
            ) from None

    # ---- views --------------------------------------------------------------------------

    @property
    def is_chain(self) -> bool:
        return self.kind == "static" and self.num_nodes == self.depth

    @property
    def max_tree_tokens(self) -> int:
        """Tokens one verify forward runs per request (drafted nodes + root)."""
        return self.num_nodes + 1

    def static_tree(self) -> Tree:
        if self.paths is None:
            raise ValueError("a dynamic TreeConfig has no fixed shape")
        return Tree.from_paths(self.paths)

    def to_vllm(self) -> str:
        """The string vLLM accepts as ``speculative_token_tree`` (static trees only)."""
        if self.auto:
            raise ValueError(
                "an auto TreeConfig chooses its tree at every step from costs measured here: vLLM's "
                "speculative_token_tree is one fixed shape; export a preset or a static tree instead"
            )
        if self.paths is None:
            raise ValueError(
                "vLLM's speculative_token_tree is a static shape: a dynamic TreeConfig has none. "
                "Export a tree drafted on a prompt with TreeConfig.static(tree.to_paths())."
            )
        return repr([tuple(p) for p in self.paths])

    def describe(self) -> str:
        if self.auto:
            rule = "" if self.objective == "step" else f", objective={self.objective}"
            return f"auto(max_depth={self.depth}, top_k={self.top_k}, max_nodes={self.num_nodes}{rule})"
        if self.kind == "dynamic":
            return f"dynamic(depth={self.depth}, top_k={self.top_k}, num_nodes={self.num_nodes})"
        if self.is_chain:
            return f"chain({self.depth})"
        return f"static({self.num_nodes} nodes, depth {self.depth})"


def _auto(cls, max_depth: int = 6, top_k: int = 8, max_nodes: int = 32, objective: str = "step") -> TreeConfig:
    """Cost-aware trees: draft EAGLE-2 style up to ``max_depth`` levels of ``top_k``, then
    verify each step the best-scoring part of at most ``max_nodes`` nodes that maximises
    expected tokens per second (possibly the root alone); see :mod:`treespec.auto`.
    ``objective="rate"`` values each node against the generation's achieved rate instead of
    the step's own."""
    return cls("dynamic", max_depth, top_k, max_nodes, auto=True, objective=objective)


# Set after the class: a method named like the field would become the field's default.
TreeConfig.auto = classmethod(_auto)


@dataclass(frozen=True)
class Preset:
    config: TreeConfig
    description: str


# EAGLE-1 static tree (SafeAILab/EAGLE, model/choices.py, `mc_sim_7b_63`): 25 nodes, depth 5.
_EAGLE1_TREE = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]

# Medusa's default 63-node tree (FasterDecoding/Medusa, medusa/model/medusa_choices.py,
# `mc_sim_7b_63`), found by simulation on Vicuna-7B.
_MEDUSA_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
    [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
    [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
    [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
    [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
    [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]


def _presets() -> Mapping[str, Preset]:
    p: dict[str, Preset] = {}
    for k in range(1, 9):
        p[f"chain-{k}"] = Preset(
            TreeConfig.chain(k),
            f"a chain of {k} drafted tokens: classic speculative decoding, what vLLM and "
            f"transformers' assisted generation draft",
        )
    p["eagle2"] = Preset(
        TreeConfig.dynamic(depth=6, top_k=10, num_nodes=59),
        "EAGLE-2 defaults for GPUs (EAGLE repository: total_token=60, depth=5, top_k=10); "
        "60 tokens per verify pays off where a verify costs about one decode step",
    )
    p["eagle2-deep"] = Preset(
        TreeConfig.dynamic(depth=8, top_k=10, num_nodes=59),
        "EAGLE-2 with EAGLE's from_pretrained defaults (total_token=60, depth=7, top_k=10); "
        "for strong heads on GPUs",
    )
    p["eagle2-qwen3"] = Preset(
        TreeConfig.dynamic(depth=9, top_k=4, num_nodes=31),
        "the EAGLE repository's evaluation setting for Qwen3 (total_token=32, depth=8, top_k=4)",
    )
    p["cpu"] = Preset(
        TreeConfig.dynamic(depth=5, top_k=4, num_nodes=16),
        "a small dynamic tree for CPUs: verifying 16-32 tokens already costs about two decode "
        "steps there (measured on SmolLM2-135M, 2 cores), so keep the tree narrow",
    )
    p["cpu-tiny"] = Preset(
        TreeConfig.dynamic(depth=4, top_k=2, num_nodes=8),
        "the smallest dynamic tree: for weak drafts or very slow verifies",
    )
    p["auto"] = Preset(
        TreeConfig.auto(max_depth=6, top_k=8, max_nodes=32),
        "cost-aware: each step verifies the part of a dynamic tree (up to depth 6, top-k 8) that "
        "maximises expected tokens per second from this machine's measured verify costs and "
        "calibrated draft scores, from the root alone up to 32 nodes; 32 is the most a 2-core CPU "
        "ever pays for (a 33-token verify costs about 2.4 decode steps there), top-k 8 lets it go "
        "wide where the draft is unsure",
    )
    p["auto-rate"] = Preset(
        TreeConfig.auto(max_depth=6, top_k=8, max_nodes=32, objective="rate"),
        "auto with the generation's rate as the bar: a node is verified when its calibrated "
        "probability beats the tokens per second achieved so far times its verify cost (the "
        "renewal-reward optimum if calibration and costs were exact); measured on a 2-core CPU "
        "it was not faster than auto (docs/benchmarks.md)",
    )
    p["eagle1"] = Preset(
        TreeConfig.static(_EAGLE1_TREE),
        "EAGLE-1's static 25-node tree (EAGLE repository, model/choices.py mc_sim_7b_63)",
    )
    p["medusa-63"] = Preset(
        TreeConfig.static(_MEDUSA_63),
        "Medusa's default 63-node static tree (Medusa repository, medusa_choices.py "
        "mc_sim_7b_63), found by simulation on Vicuna-7B",
    )
    return MappingProxyType(p)


PRESETS: Mapping[str, Preset] = _presets()
