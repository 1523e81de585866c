"""Mean accepted length (tau) with generation options, drafts that honour them against drafts
that do not, the shipped head with prompt lookup on fixed trees (``--drafts head,lookup``:
each alone).

Feeds docs/generation.md, "What the options cost". Greedy, bf16; the prompts: GSM8K test
questions and Spec-Bench conversation first turns. tau depends only on the tokens, not on
timing (the trees are fixed, not ``auto``), so a busy machine does not change it. Drafts:
"blind" turns treespec.constraints off (no mask in the builder, no pruning: the drafts of
before it), "bans" honours the hard constraints only, "all" applies the repetition penalty
to the draft's log-probabilities too (the default). ``--penalty-offset C`` adds "shifted": the
target's own rule (divide a positive logit by the penalty, multiply a negative one) applied to
the draft's log-probability plus C, as if it were the target's logit (C: the target's typical
log-sum-exp, printed), an experiment kept out of the library (docs/generation.md).

    python benchmarks/micro/tau_options.py --num-prompts 10 --out benchmarks/results/tau-options.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if "treespec" not in sys.modules and not any("treespec" in p for p in sys.path[1:]):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's treespec

import torch  # noqa: E402

import treespec  # noqa: E402
import treespec.constraints as constraints  # noqa: E402
from treespec.constraints import DraftRules  # noqa: E402
from treespec.drafters import HybridDrafter  # noqa: E402
from treespec.models import load  # noqa: E402
from treespec.prompts import load_prompts  # noqa: E402

OPTIONS = {
    "none": {},
    "repetition_penalty=1.1": dict(repetition_penalty=1.1),
    "no_repeat_ngram_size=4": dict(no_repeat_ngram_size=4),
    "both": dict(repetition_penalty=1.1, no_repeat_ngram_size=4),
}


def tau(model, draft, tree, prompts, max_new, options) -> tuple[float, list[list[int]]]:
    accepted = steps = 0
    outputs = []
    for prompt in prompts:
        out = treespec.generate(model, draft, tree, prompt, max_new_tokens=max_new, **options)
        accepted += out.metrics.num_generated - 1  # the first token comes from the prefill
        steps += out.metrics.num_steps
        outputs.append(out.sequences[0])
    return accepted / max(steps, 1), outputs


def rules_for(mode: str):
    """A replacement for DraftRules.from_processors: the drafts' knowledge of the options."""
    full = DraftRules.from_processors

    def made(processors, sequence):
        r = full(processors, sequence)
        if r is None or mode == "all":
            return r
        if mode == "blind":
            return None
        r.penalty = 1.0
        return r if r.bans else None

    return staticmethod(made)


def shifted_penalty(offset: float):
    """A replacement for constraints._penalised: the target's rule on ``logp + offset``."""

    def penalised(rules, paths, logp, to_draft):
        V = logp.shape[-1]
        out = logp.clone()
        for b, r in enumerate(rules):
            if r is None or r.penalty == 1.0:
                continue
            seen = constraints.seen_mask(r, paths[b], V, to_draft).to(logp.device)
            raw = logp[b] + offset
            out[b] = torch.where(seen, torch.where(raw > 0, raw / r.penalty, raw * r.penalty) - offset, logp[b])
        return out

    return penalised


_PENALISED = constraints._penalised


def target_log_sum_exp(model, prompts) -> float:
    """The median log-sum-exp of the target's logits over the first prompts' positions."""
    with torch.no_grad():
        lse = [model(torch.tensor([p])).logits[0].float().logsumexp(-1) for p in prompts[:4]]
    return float(torch.cat(lse).median())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--trees", default="cpu,chain-3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--options", default=",".join(OPTIONS), help="which rows of OPTIONS, comma-separated")
    p.add_argument("--modes", default="all,bans,blind",
                   help="the drafts' knowledge of the options to run (shifted: only with --penalty-offset)")
    p.add_argument("--drafts", default="hybrid",
                   help="comma-separated: hybrid (the shipped head with prompt lookup), head, lookup")
    p.add_argument("--head", default="smollm2-135m-instruct-eagle",
                   help="the EAGLE head: a shipped name or a folder (e.g. one trained on a capture with options)")
    p.add_argument("--penalty-offset", default=None,
                   help="also run drafts 'shifted' (see above) with this offset; 'lse' for the target's median")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("smollm2-135m-instruct", dtype=torch.bfloat16)
    head = treespec.load_draft(args.head, model)
    hybrid = HybridDrafter(head)
    drafts = {"hybrid": hybrid, "head": head, "lookup": hybrid.lookup}
    if bad := [d for d in args.drafts.split(",") if d not in drafts]:
        p.error(f"unknown --drafts {', '.join(bad)}: choose from {', '.join(drafts)}")
    sets = {name: load_prompts(name, tok, args.num_prompts)[0] for name in ("gsm8k", "spec-bench:conversation")}
    res = {"treespec": treespec.__file__, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
           "head": args.head, "drafts": {d: str(drafts[d]) for d in args.drafts.split(",")}, "dtype": "bfloat16", "tau": {}}
    honour = DraftRules.__dict__["from_processors"]  # the classmethod itself, to put back
    offset = None
    if args.penalty_offset is not None:
        offset = (target_log_sum_exp(model, sets["gsm8k"]) if args.penalty_offset == "lse"
                  else float(args.penalty_offset))
        res["penalty_offset"] = round(offset, 3)
        print(f"penalty offset {offset:.2f}", flush=True)
    runs = [(d, ps, x, t) for d, ps in sets.items() for x in args.drafts.split(",") for t in args.trees.split(",")]
    for dataset, prompts, dname, tree in runs:
        draft = drafts[dname]
        label = "" if dname == "hybrid" else f" {dname}"  # the hybrid's keys as before
        for name in args.options.split(","):
            options = OPTIONS[name]
            modes = tuple(args.modes.split(",")) if options else ("all",)
            if offset is not None and options.get("repetition_penalty") and "shifted" not in modes:
                modes += ("shifted",)
            for mode in modes:
                DraftRules.from_processors = honour if mode in ("all", "shifted") else rules_for(mode)
                if mode == "shifted":
                    constraints._penalised = shifted_penalty(offset)
                try:
                    t, outs = tau(model, draft, tree, prompts, args.max_new_tokens, options)
                finally:
                    DraftRules.from_processors = honour
                    constraints._penalised = _PENALISED
                key = f"{dataset}{label} {tree} {name} drafts {mode}"
                res["tau"][key] = round(t, 3)
                res.setdefault("outputs", {})[key] = outs
                print(f"{key}: tau {t:.3f}", flush=True)
        for name in args.options.split(","):  # the drafts change the speed, never the tokens
            outs = [v for k, v in res["outputs"].items() if k.startswith(f"{dataset}{label} {tree} {name} drafts ")]
            if OPTIONS[name] and len(outs) > 1:
                res.setdefault("same_tokens", {})[f"{dataset}{label} {tree} {name}"] = all(o == outs[0] for o in outs)
    res.pop("outputs")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
