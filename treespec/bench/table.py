"""A benchmark's figures as a plain-text table (:func:`format_table`): within
:data:`TABLE_WIDTH` columns unless wide, the Spec-Bench leaderboard first where the prompts
have categories, and a legend saying what every column means."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .configs import HF_GENERATE, HF_LOOKUP, PEER, TREESPEC, TREESPEC_AR
from .report import header_lines


def _fmt(v, spec, suffix=""):
    return "-" if v is None else format(v, spec) + suffix


#: table width the default table and legend keep to (``wide=True`` lifts it)
TABLE_WIDTH = 100
_NAME_WIDTH = 24  # config names beyond this are abbreviated in the default table
#: Spec-Bench's categories as the default table heads them
_CATEGORY_HEADS = {"conversation": "conv", "translation": "transl", "summarization": "summ", "qa": "qa",
                   "math_reasoning": "math", "rag": "rag"}
_CATEGORY_MEANING = {"conversation": "MT-bench's 80, two turns each", "translation": "WMT14 DE-EN",
                     "summarization": "CNN/DailyMail", "qa": "question answering, Natural Questions",
                     "math_reasoning": "GSM8K", "rag": "retrieval-augmented generation, DPR"}


_TAU = ("mean accepted length: tokens committed per verify forward of the target, its own (bonus) token included; "
        "treespec's, and a peer's where the engine counts it (vLLM: over the steps that drafted)")


@dataclass(frozen=True)
class _Column:
    head: str
    cell: Callable[[dict], str]
    meaning: str
    wide_only: bool = False
    left: bool = False


def _mismatch_cell(c: dict, greedy: bool, wide: bool) -> str:
    if not greedy or c["kind"] == HF_GENERATE or c.get("mismatches") is None:
        return "-"
    if c["kind"] == PEER:  # another engine's arithmetic on other weights: counted, never judged
        return f"{c['mismatches']} differ" if c["mismatches"] else "0"
    n, bad = c["mismatches"], c.get("unexplained", c["mismatches"])
    if not n:
        return "0"
    if wide:
        return f"{n}: {c.get('near_ties', 0)} near-tie, {bad} unexplained"
    return f"{n} ({bad} unexpl.)" if bad else f"{n} near-tie"


def _main_columns(data: dict, wide: bool, max_positions: int) -> list[_Column]:
    """The columns of the main table, each with what it means (the legend's text)."""
    best = data.get("best_baseline", "-")
    greedy = data["settings"]["temperature"] == 0

    def accept(c):
        acc = c.get("acceptance_rate_by_position")
        return "-" if acc is None else " ".join(f"{a:.2f}" for a in acc[:max_positions]) + (
            " ..." if len(acc) > max_positions else "")

    def share(key):
        return lambda c: f"{100 * c['time_split'][key]:.0f}%" if c.get("time_split") else "-"

    return [
        _Column("tok/s", lambda c: _fmt(c["tokens_per_second"], ".1f"),
                "generated tokens / wall seconds, all prompts together (tokenisation excluded)"),
        _Column("med tok/s", lambda c: _fmt(c["median_tokens_per_second"], ".1f"),
                "median over prompts of a prompt's tokens / seconds", wide_only=True),
        _Column("speedup", lambda c: _fmt(c["speedup"], ".2f", "x"), f"tok/s over {HF_GENERATE}'s"),
        _Column("med speedup", lambda c: _fmt(c["median_speedup"], ".2f", "x"),
                "median over prompts of a prompt's speedup", wide_only=True),
        _Column("vs best", lambda c: _fmt(c.get("speedup_vs_best_baseline"), ".2f", "x"),
                f"tok/s over {best}'s, the fastest configuration without speculation here: what speculation "
                "itself adds"),
        _Column("tau", lambda c: _fmt(c["mean_accepted_length"], ".2f"), _TAU),
        _Column("nodes", lambda c: _fmt(c.get("mean_tree_size") if c.get("acceptance_rate_by_position") else None,
                                        ".1f"),
                "drafted tree nodes verified per step, mean (auto trees choose their size each step)"),
        _Column("accept by position", accept, f"share of verify steps that accepted at least d drafted tokens, "
                f"d = 1, 2, ... (first {max_positions})", wide_only=True, left=True),
        _Column("draft", share("draft"), "share of treespec's time spent drafting (the head, draft model or prompt "
                "lookup building each step's tree)"),
        _Column("verify", share("verify"), "share spent in the target's verify forwards (the rest: prefill and "
                "committing)"),
        _Column("mismatch", lambda c: _mismatch_cell(c, greedy, wide),
                "greedy only: prompts whose output differs from HF generate's, each judged in fp32 at its first "
                "differing token and at every later one on its own prefix: a rounding near-tie (bf16 or packed "
                "weights can round two logits level) or unexplained (a bug; bench exits with status 1); '-' not "
                "compared" + ("; a peer's: prompts whose output differs, not judged (another engine's arithmetic: "
                              "llama.cpp's on the GGUF's quantized weights, vLLM's own CPU kernels)" if any(c["kind"] == PEER for c in data["configs"]) else "")),
    ]


def _category_columns(data: dict, wide: bool) -> tuple[list[_Column], str, str]:
    """The leaderboard's columns (speedup per category, mean accepted tokens, overall), and the
    legend's one entry for the category columns: its key and text."""
    heads = {cat: cat if wide else _CATEGORY_HEADS.get(cat, cat) for cat in data["categories"]}
    cols = [_Column(head, lambda c, cat=cat: _fmt(c["categories"][cat]["speedup"], ".2f", "x"), "")
            for cat, head in heads.items()]
    cols += [_Column("tau", lambda c: _fmt(c["mean_accepted_length"], ".2f"), _TAU),
             _Column("overall", lambda c: _fmt(c.get("overall_speedup"), ".2f", "x"),
                     "mean of the categories' speedups"),
             _Column("SB overall", lambda c: _fmt(c.get("overall_spec_bench_speedup"), ".2f", "x"),
                     "Spec-Bench's own Overall: the mean of every question's tokens/s over the baseline's mean "
                     "(evaluation/speed.py), which weighs short answers as much as long ones")]
    what = [f"{cat} ({_CATEGORY_MEANING.get(cat, 'an MT-bench category, two turns each')})"
            if head == cat else f"{head}: {cat} ({_CATEGORY_MEANING.get(cat, '')})" for cat, head in heads.items()]
    return cols, ", ".join(heads.values()), (
        f"speedup over {HF_GENERATE} per Spec-Bench category (tokens / seconds over its questions): " + "; ".join(what))


def _short_names(configs: list[dict], limit: int) -> tuple[dict[str, str], dict[str, str]]:
    """Names that fit ``limit`` characters: a long draft name becomes ``head`` (an EAGLE head)
    or ``draft`` (numbered if there are several); and the aliases used, alias -> draft."""
    aliases: dict[str, str] = {}  # draft -> alias
    names = {}
    for c in configs:
        name = c["name"]
        if c["kind"] == TREESPEC and len(name) > limit and c.get("draft") and c.get("tree"):
            base = c["draft"].removesuffix("+lookup")
            if base not in aliases and len(base) > 12:
                kind = "head" if "EAGLE" in c.get("drafter", "") else "draft"
                n = sum(a.rstrip("0123456789") == kind for a in aliases.values())
                aliases[base] = kind if n == 0 else f"{kind}{n + 1}"
            name = f"{aliases.get(base, base)}{c['draft'][len(base):]}/{c['tree']}" + ("+compile" if c.get("compiled")
                                                                                       else "")
        names[c["name"]] = name if len(name) <= limit else name[: limit - 1] + "~"
    return names, {a: d for d, a in aliases.items()}


def _config_meaning(data: dict, configs: list[dict], aliases: dict[str, str]) -> str:
    names = {c["name"] for c in configs}
    kinds = {c["kind"] for c in configs}
    parts = [f"{HF_GENERATE}: transformers' model.generate, eager weights, the baseline of every speedup"]
    if any(n.endswith("+fast") for n in names):
        parts.append(f"+fast: the same on {data['settings'].get('fast_path') or 'packed weights'}")
    if f"{HF_GENERATE}+compile" in names:
        parts.append("+compile: with a static cache and torch.compile")
    if any(c["kind"] == TREESPEC and c.get("compiled") for c in configs):
        parts.append("treespec's +compile: its verify forward compiled on fixed shapes and an EAGLE head's passes "
                     "compiled (torch.compile; the warm-up compiles)")
    if TREESPEC_AR in names:
        parts.append(f"{TREESPEC_AR}: treespec without a draft (one token per forward, on treespec's weights): its "
                     "decoding without speculation")
    if HF_LOOKUP in kinds:
        fast = data["settings"].get("fast_path") and any(c["kind"] == HF_LOOKUP and c.get("fast") for c in configs)
        on = " (on the +fast weights)" if fast else ""
        parts.append(f"{HF_LOOKUP}-K: transformers' prompt lookup decoding, K tokens{on}")
    if any(c["kind"] == TREESPEC and c.get("draft") != "none" for c in configs):
        parts.append("DRAFT/TREE: treespec drafting with DRAFT (+lookup: prompt lookup grafted on) on trees TREE")
    if PEER in kinds:
        parts.append("peer:ENGINE: another engine, run on this run's prompts and token budget (benchmarks/peers/): "
                     + "; ".join(f"{c['name']} = {c['description']}" for c in configs if c["kind"] == PEER))
    parts += [f"{a} = {d}" for a, d in aliases.items()]
    return "; ".join(parts)


def _render(head: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    widths = [max(len(r[j]) for r in [head] + rows) for j in range(len(head))]

    def line(r):
        return "  ".join(f"{v:<{w}}" if j in left else f"{v:>{w}}" for j, (v, w) in enumerate(zip(r, widths))).rstrip()

    return [line(head), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [line(r) for r in rows]


def format_table(data: dict, max_positions: int = 5, *, wide: bool = False, legend: bool = True) -> str:
    """``to_json``'s ``configs`` as aligned plain text, within :data:`TABLE_WIDTH` columns
    unless ``wide``; and under it a legend that says what every column means.

    Where the prompts have categories (Spec-Bench), the leaderboard's table comes first: a
    row per configuration, speedup per category, mean accepted tokens and overall.
    ``wide`` adds the medians and acceptance by position, and keeps names unabbreviated.
    """
    configs = [c for c in data["configs"] if not c.get("skipped")]
    names, aliases = (({c["name"]: c["name"] for c in configs}, {}) if wide
                      else _short_names(configs, _NAME_WIDTH))
    meanings = {"config": _config_meaning(data, configs, aliases)}
    lines = []
    tables = [_main_columns(data, wide, max_positions)]
    if data.get("categories"):
        cols, key, text = _category_columns(data, wide)
        tables.insert(0, cols)
        meanings[key] = text
    for cols in tables:
        cols = [col for col in cols if wide or not col.wide_only]
        rows = [[names[c["name"]]] + [col.cell(c) for col in cols] for c in configs]
        lines += _render(["config"] + [col.head for col in cols], rows,
                         {0} | {j + 1 for j, col in enumerate(cols) if col.left}) + [""]
        for col in cols:
            if col.meaning:
                meanings.setdefault(col.head, col.meaning)
    lines.pop()
    lines += [f"{c['name']} skipped: {c['skipped']}" for c in data["configs"] if c.get("skipped")]
    return "\n".join(lines + (["", _legend(meanings)] if legend else []))


def format_report(data: dict, *, wide: bool = False) -> str:
    """The report ``treespec bench`` prints and writes beside its JSON (the .txt, under the
    command's line), drawn from ``to_json``'s output and the CLI's extra keys (``model``,
    ``dataset``, ``prompt_format``) alone, so that a report read back redraws byte for byte:
    the title, :func:`header_lines`, :func:`format_table` and the notes."""
    prompts = data["prompts"]
    counts = {c: sum(p.get("category") == c for p in prompts) for c in data.get("categories", [])}
    s = data["settings"]
    title = (f"{data['model']} on {data['dataset']} ({data['prompt_format']} prompts): {s['num_prompts']} prompt(s)"
             + _per_category(counts) + f", {s['max_new_tokens']} new tokens"
             + (" a turn" if any(p.get("turns", 1) > 1 for p in prompts) else "")
             + ", " + ("greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"))
    return "\n".join([_wrap(title), *(_wrap(line) for line in header_lines(data)), format_table(data, wide=wide),
                      *(_wrap(f"note: {note}") for note in data["notes"])]) + "\n"


def _per_category(counts: dict[str, int]) -> str:
    if not counts:
        return ""
    if len(set(counts.values())) == 1:
        return f", {next(iter(counts.values()))} per category"
    return " (" + ", ".join(f"{n} {c}" for c, n in counts.items()) + ")"


def _wrap(text: str) -> str:
    """A line of the report within the table's width (a long path stays whole)."""
    import textwrap

    return textwrap.fill(text, TABLE_WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def _legend(meanings: dict[str, str]) -> str:
    """``head  meaning`` per column, wrapped to :data:`TABLE_WIDTH`; a long head (the
    categories' shared entry) as ``head: meaning``."""
    import textwrap

    w = max(len(h) for h in meanings if len(h) <= 18)
    return "\n".join(textwrap.fill(text, TABLE_WIDTH, subsequent_indent=" " * (w + 2), break_on_hyphens=False,
                                   initial_indent=f"{head:<{w}}  " if len(head) <= w else f"{head}: ")
                     for head, text in meanings.items())
