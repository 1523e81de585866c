"""What a benchmark runs: :class:`BenchConfig`, one way to generate (and the names of its
kinds), and :class:`BenchSettings`, how every configuration runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import TreeConfig
from ..drafters.base import Drafter
from ..sampling_args import SamplingParams

HF_GENERATE = "hf-generate"
HF_LOOKUP = "hf-prompt-lookup"
TREESPEC = "treespec"
TREESPEC_AR = "treespec-ar"
#: a row another engine ran on a report's prompts (benchmarks/peers/run.py adds it; no BenchConfig runs it)
PEER = "peer"


@dataclass(frozen=True)
class BenchConfig:
    """One way to generate.

    kind:   ``"hf-generate"`` (the baseline; always runs first), ``"hf-prompt-lookup"``
            (assisted generation with ``prompt_lookup_num_tokens=lookup_tokens``, greedy
            only) or ``"treespec"`` (``drafter`` with ``tree``).
    fast:   runs inside the benchmark's fast path (e.g. oneDNN-packed weights), when it
            has one. Plain ``hf-generate`` never does: it is the baseline a user has
            without treespec; ``hf-generate+fast`` is the same with the fast path. treespec's
            configurations run there where packing pays (``PackingChoice.pack``).
    """

    name: str
    kind: str
    drafter: Drafter | None = None
    tree: TreeConfig | None = None
    lookup_tokens: int = 3
    draft_name: str | None = None
    tree_name: str | None = None
    fast: bool = True
    compiled: bool = False  # hf-generate: static cache + torch.compile; treespec: fixed_shapes="compile"

    def __post_init__(self):
        if self.kind not in (HF_GENERATE, HF_LOOKUP, TREESPEC):
            raise ValueError(f"unknown configuration kind {self.kind!r}")
        if self.kind == TREESPEC and (self.drafter is None or self.tree is None):
            raise ValueError(f"treespec configuration {self.name!r} needs a drafter and a tree")
        if self.kind == HF_LOOKUP and self.lookup_tokens < 1:
            raise ValueError(f"prompt lookup needs lookup_tokens >= 1, got {self.lookup_tokens}")

    @classmethod
    def hf_generate(cls, fast: bool = False) -> "BenchConfig":
        return cls(f"{HF_GENERATE}+fast" if fast else HF_GENERATE, HF_GENERATE, fast=fast)

    @classmethod
    def hf_generate_compiled(cls) -> "BenchConfig":
        """HF generate with a static cache and ``torch.compile`` of the forward (transformers
        compiles on CPU only when asked): the first call compiles (a minute or more)."""
        return cls(f"{HF_GENERATE}+compile", HF_GENERATE, fast=False, compiled=True)

    @classmethod
    def treespec_ar(cls, fast: bool = True) -> "BenchConfig":
        """treespec without speculation (every tree is the root alone): autoregressive
        decoding through treespec's runner, on the weights treespec runs on (``fast``: the
        fast path), a baseline for speculation."""
        from ..drafters.none import NoDrafter

        return cls(TREESPEC_AR, TREESPEC, NoDrafter(), TreeConfig.chain(1), draft_name="none", tree_name="root only",
                   fast=fast)

    @classmethod
    def hf_lookup(cls, k: int = 3) -> "BenchConfig":
        return cls(f"{HF_LOOKUP}-{k}", HF_LOOKUP, lookup_tokens=k)

    @classmethod
    def treespec(cls, drafter: Drafter, tree: TreeConfig, draft_name: str, tree_name: str,
                 fast: bool = True) -> "BenchConfig":
        return cls(f"{draft_name}/{tree_name}", TREESPEC, drafter, tree,
                   draft_name=draft_name, tree_name=tree_name, fast=fast)

    def compiled_twin(self) -> "BenchConfig":
        """This treespec configuration with its verify forward on fixed shapes, compiled
        (``generate(..., fixed_shapes="compile")``), and an EAGLE head's passes compiled
        (``with_compiled_passes``), named ``NAME+compile``."""
        if self.kind != TREESPEC:
            raise ValueError(f"only treespec configurations have a compiled twin, not {self.name!r}")
        compiled = getattr(self.drafter, "with_compiled_passes", None)
        return dataclasses.replace(self, name=f"{self.name}+compile", compiled=True,
                                   drafter=compiled() if compiled is not None else self.drafter)

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "fast": self.fast}
        if self.compiled and self.kind == TREESPEC:  # hf-generate+compile's name says it (older journals)
            d["compiled"] = True
        if self.kind == HF_LOOKUP:
            d["prompt_lookup_num_tokens"] = self.lookup_tokens
        if self.kind == TREESPEC:
            d.update(draft=self.draft_name, drafter=repr(self.drafter), tree=self.tree_name,
                     tree_config=self.tree.describe(), tree_tokens_per_verify=self.tree.max_tree_tokens)
        return d

    @property
    def speculates(self) -> bool:
        from ..drafters.none import NoDrafter

        return self.kind == HF_LOOKUP or (self.kind == TREESPEC and not isinstance(self.drafter, NoDrafter))


@dataclass(frozen=True)
class BenchSettings:
    """How :func:`~treespec.bench.run_bench` runs every configuration: the keywords it takes
    (all but ``callback``), as one value.

    max_new_tokens: per prompt, and per turn of a multi-turn prompt.
    temperature, top_k, top_p, min_p: sampling (``temperature=0``: greedy, every output
              checked token for token against HF generate's); as :attr:`sampling`.
    seed:     prompt i is sampled with seed ``seed + i`` in every configuration.
    warmup:   one untimed generate per configuration on a short prompt first (first calls
              run several times slower: allocations, kernel selection).
    attention_backend: treespec's (``generate``'s ``attention_backend``).
    verify_graphs: on a CUDA device, treespec's verify forward captured in CUDA graphs
              (``generate(..., fixed_shapes="graphs")``) where a configuration is not compiled.
    hf_cache_len: the length of the static cache HF generate's compiled baseline runs on, the
              same in every call so that its decode compiles once, in the warm-up (a call that
              outgrows it allocates a longer one and compiles again, inside its time); None:
              :func:`~treespec.bench.run_bench` sizes it for the prompts.
    fast_path: a context manager (e.g. :class:`~treespec.packing.PackedLinears`) that every
              configuration with ``fast=True`` runs inside; plain HF generate runs outside it,
              ``BenchConfig.hf_generate(fast=True)`` inside: the faster of the two is the
              same-path baseline.
    near_tie_tolerance: greedy differences from HF generate are judged in fp32
              (:mod:`treespec.divergence`); default by the model's dtype.
    auto_profile: the :class:`~treespec.auto.AutoProfile` that ``auto`` trees start from
              (each auto configuration learns into its own copy, across its warm-up and
              prompts); None: a fresh one each (cost curve from the disk cache, calibrations
              the draft's own or else the prior).
    options:  generation options (GenerationConfig fields: ``repetition_penalty``, ...), given
              to every configuration alike, HF's baselines included.
    tokenizer: for ``stop_strings`` among the options (transformers needs it too), and to
              template a multi-turn prompt's later turns.
    packing:  the :class:`~treespec.pack_choice.PackingChoice` behind the ``fast`` flags.
    journal:  a JSONL file each finished prompt is appended to, from which a stopped run with
              the same settings resumes (:class:`~treespec.bench.journal.Journal`).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = 0
    warmup: bool = True
    attention_backend: str = "auto"
    verify_graphs: bool = False
    hf_cache_len: int | None = None
    fast_path: Any = None
    near_tie_tolerance: float | None = None
    auto_profile: Any = None
    options: dict | None = None  # None reads as {}
    tokenizer: Any = None
    packing: Any = None
    journal: str | Path | None = None
    sampling: SamplingParams = field(init=False, repr=False)  # from temperature, top_k, top_p and min_p

    def __post_init__(self):
        object.__setattr__(self, "sampling", SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        object.__setattr__(self, "options", dict(self.options or {}))
