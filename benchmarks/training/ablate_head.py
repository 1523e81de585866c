"""Ablations of the EAGLE head (issue 10): one capture, one factor varied per row.

Trains a head per row from the shards of one capture (``treespec capture``), validates each
on one held-out capture (top-1 agreement with the target's greedy token, by training-time
test step), and measures tau (tokens per target forward, greedy, batch 1, exactly as
``treespec bench`` pools it) on the evaluation prompts with each tree. Appends one JSON
line per row to ``OUT/results.jsonl`` (a row already there is skipped: rerun to resume)
and rewrites ``OUT/results.md`` from it.

    python benchmarks/training/ablate_head.py --capture runs/cap-all --reference-capture runs/cap-ref \\
        --val-capture runs/cap-val --out runs/ablate            # every row
    python benchmarks/training/ablate_head.py ... --only base,vocab-8192  # some rows
    python benchmarks/training/ablate_head.py ... --existing shipped=smollm2-135m-instruct-eagle  # a row for a head trained elsewhere

Rows (the base: the first --base-examples conversations (default every one), target-written
answers, draft vocabulary 4096, 3 training-time-test steps, EAGLE-3; every other row changes
one thing):

    base             the first --base-examples conversations of --capture (default: all)
    data-N           the first N conversations, for each N of --sizes ("all": every one);
                     every prefix keeps the capture's mix
    vocab-8192/16384 draft vocabulary (--vocabs: the base's, then these two)
    ttt-1/ttt-5      training-time-test steps
    eagle1           the EAGLE-1/2 layout (final-state feature, full vocabulary), same capture
    gsm8k-target     the first 2,500 GSM8K-train conversations of --capture (target-written answers)
    gsm8k-reference  the same 2,500 questions from --reference-capture (GSM8K's reference answers)

tau is a count, not a timing: it does not depend on the machine's load (greedy decoding of
the same prompts gives the same tokens), so this can run beside other work; wall times
(training) can not.

Feeds docs/training.md, "Ablations (issue 10)".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("ablate_head")


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    train: dict = field(default_factory=dict)  # TrainConfig fields beyond the base
    reference: bool = False  # train on --reference-capture instead of --capture


def rows(sizes=(2500, 7500), vocabs=(4096, 8192, 16384), gsm8k_n: int = 2500,
         source: str = "gsm8k-train", base_examples: int | None = None) -> list[Row]:
    """The ablation table; ``sizes`` holds conversation counts, ``None`` for all of them."""
    base_vocab, v2, v3 = vocabs
    first = f"first {base_examples}" if base_examples else "all"
    table = [
        Row("base", f"{first}, target answers, vocab {base_vocab}, TTT 3, EAGLE-3"),
        *(Row(f"data-{_k(n) if n else 'all'}", f"first {n} conversations" if n else "all conversations",
              {"max_examples": n}) for n in sizes),
        Row(f"vocab-{v2}", f"draft vocabulary {v2}", {"draft_vocab_size": v2}),
        Row(f"vocab-{v3}", f"draft vocabulary {v3}", {"draft_vocab_size": v3}),
        Row("ttt-1", "1 training-time-test step", {"ttt_steps": 1}),
        Row("ttt-5", "5 training-time-test steps", {"ttt_steps": 5}),
        Row("eagle1", "EAGLE-1/2 layout (final state, full vocabulary)", {"eagle3": False, "draft_vocab_size": None}),
        Row("soft", "soft labels: the target's distribution over the draft vocabulary", {"soft_labels": True}),
        Row("lr-3e-3", "learning rate 3e-3 (base 1e-3)", {"lr": 3e-3}),
        Row("gsm8k-target", f"{source}, first {gsm8k_n}, target-written answers",
            {"max_examples": gsm8k_n, "captured_source": source}),
        Row("gsm8k-reference", f"{source}, first {gsm8k_n}, reference answers",
            {"max_examples": gsm8k_n, "captured_source": source}, reference=True),
    ]
    base = {"draft_vocab_size": base_vocab, "max_examples": base_examples}
    return [Row(r.name, r.what, {**base, **r.train}, r.reference) for r in table]


def _k(n: int) -> str:
    return f"{n / 1000:g}k" if n >= 1000 else str(n)


def tau(model, drafter, tree: str, prompts, max_new_tokens: int) -> float:
    """Tokens per verify forward over all prompts, pooled as treespec bench pools them."""
    import treespec

    acc = []
    for ids in prompts:
        out = treespec.generate(model, drafter, tree, ids, max_new_tokens=max_new_tokens)
        acc.extend(out.metrics.requests[0].accepted)
    return (sum(acc) + len(acc)) / max(len(acc), 1)


def taus(drafter, model, prompt_sets, args) -> dict[str, float]:
    """tau of ``drafter`` on every prompt set with every tree, on packed weights where supported."""
    from treespec.packing import PackedLinears, packing_supported

    out = {}
    pack = packing_supported(model)
    if not pack:
        log.info("tau on plain weights: oneDNN cannot pack %s here (tau is a count: the same, only slower)",
                 next(model.parameters()).dtype)
    with PackedLinears(model) if pack else contextlib.nullcontext():
        for name, prompts in prompt_sets.items():
            for tree in args.trees:
                out[f"{name}@{tree}"] = round(tau(model, drafter, tree, prompts, args.max_new_tokens), 3)
    return out


def run_row(row: Row, args, model_train, tok, model_eval, prompt_sets) -> dict:
    from treespec.drafters import load_draft
    from treespec.train import TrainConfig, train_eagle

    out = Path(args.out) / row.name
    captured = args.reference_capture if row.reference else args.capture
    if captured is None:
        raise SystemExit(f"row {row.name} needs --reference-capture")
    cfg = TrainConfig(data="", out_dir=str(out), captured=captured, val_captured=args.val_capture,
                      seed=args.seed, val_examples=args.val_examples,
                      **{"batch_size": args.batch_size, "epochs": args.epochs, **row.train})
    t0 = time.perf_counter()
    train_eagle(model_train, tok, cfg)
    train_s = time.perf_counter() - t0
    val = dict(line.split(" ", 1) for line in (out / "validation.txt").read_text().splitlines())
    result = {
        "name": row.name, "what": row.what, "captured": captured, "train": {k: v for k, v in row.train.items()},
        "epochs": cfg.epochs, "train_seconds": round(train_s, 1),
        "val_loss": float(val["loss"]), "top1_by_step": [float(x) for x in val["top1_by_step"].split()],
        "tau": {},
    }
    result["tau"] = taus(load_draft(out / "head", model_eval), model_eval, prompt_sets, args)
    return result


def existing_row(name: str, head: str, args, model_train, model_eval, prompt_sets) -> dict:
    """A row for a head trained elsewhere (e.g. the shipped one): validated on the same
    held-out conversations and measured on the same prompts as the trained rows."""
    from treespec.drafters import load_draft
    from treespec.train import validate
    from treespec.train.capture import load_shards

    trained = load_draft(head, model_train).head.float().eval()
    records = load_shards(args.val_capture, eagle3=trained.config.eagle3, greedy_only=True)[: args.val_examples]
    loss, top1 = validate(trained, records, ttt_steps=3)
    result = {"name": name, "what": f"existing head {head}", "head": head, "train": {}, "epochs": None,
              "train_seconds": None, "val_loss": round(loss, 4), "top1_by_step": [round(a, 4) for a in top1],
              "tau": {}}
    result["tau"] = taus(load_draft(head, model_eval), model_eval, prompt_sets, args)
    return result


def write_markdown(results: list[dict], path: Path) -> None:
    cols = sorted({k for r in results for k in r["tau"]})
    head = "| row | what | held-out top-1 by step | val loss | " + " | ".join(f"tau {c}" for c in cols) + " | train s |"
    lines = [head, "|" + "---|" * (5 + len(cols))]
    for r in results:
        top1 = " / ".join(f"{a:.3f}" for a in r["top1_by_step"])
        taus = " | ".join(f"{r['tau'][c]:.2f}" if c in r["tau"] else "" for c in cols)
        secs = "" if r["train_seconds"] is None else f"{r['train_seconds']:.0f}"
        lines.append(f"| {r['name']} | {r['what']} | {top1} | {r['val_loss']:.3f} | {taus} | {secs} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--capture", required=True, help="the capture folder every row but gsm8k-reference trains on")
    ap.add_argument("--reference-capture", default=None, help="capture of GSM8K train with --answers reference")
    ap.add_argument("--val-capture", required=True, help="held-out capture (target answers) for top-1 by step")
    ap.add_argument("--out", required=True, help="one folder per row, results.jsonl and results.md")
    ap.add_argument("--only", default=None, help="comma-separated row names (default: all)")
    ap.add_argument("--existing", action="append", default=[], metavar="NAME=HEAD",
                    help="also a row for a head trained elsewhere (shipped name or folder), validated and "
                         "measured like the others; repeatable")
    ap.add_argument("--base-examples", type=int, default=None,
                    help="conversations every row but data-* trains on (default: all of --capture)")
    ap.add_argument("--sizes", default="2500,7500", help="data sizes of the data-* rows ('all': every one)")
    ap.add_argument("--vocabs", default="4096,8192,16384", help="the base draft vocabulary, then the two others")
    ap.add_argument("--gsm8k-examples", type=int, default=2500, help="conversations of the answers ablation")
    ap.add_argument("--answers-source", default="gsm8k-train",
                    help="the dataset (as named in both captures' --data) of the answers ablation")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--val-examples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", default="gsm8k:50,humaneval:20,chat:48",
                    help="DATASET:N,... prompts for tau (treespec bench datasets or .jsonl files)")
    ap.add_argument("--trees", default="chain-3,cpu")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="target dtype for tau")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    args.trees = args.trees.split(",")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from treespec import models
    from treespec.prompts import load_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = tuple(None if x == "all" else int(x) for x in args.sizes.split(","))
    vocabs = tuple(int(x) for x in args.vocabs.split(","))
    table = rows(sizes, vocabs, args.gsm8k_examples, args.answers_source, args.base_examples)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {r.name for r in table}
        if unknown:
            raise SystemExit(f"unknown rows {sorted(unknown)}; rows: {', '.join(r.name for r in table)}")
        table = [r for r in table if r.name in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.jsonl"
    results = [json.loads(x) for x in res_path.read_text().splitlines()] if res_path.exists() else []
    done = {r["name"] for r in results}

    model_train, tok = models.load(args.model)  # fp32: the head starts from its output rows
    model_eval, _ = models.load(args.model, dtype=getattr(torch, args.dtype))
    prompt_sets = {}
    for item in args.eval.split(","):
        name, _, n = item.rpartition(":")
        prompt_sets[Path(name).stem if name.endswith(".jsonl") else name] = load_prompts(name, tok, int(n))[0]
    command = "python benchmarks/training/ablate_head.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for item in args.existing:
        name, sep, head = item.partition("=")
        if not sep or not name or not head:
            raise SystemExit(f"--existing takes NAME=HEAD, got {item!r}")
        if name in done:
            log.info("%s: already in %s, skipped", name, res_path)
            continue
        r = existing_row(name, head, args, model_train, model_eval, prompt_sets)
        r["command"] = command
        with res_path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        results.append(r)
        done.add(name)
        log.info("%s: top-1 %s, tau %s", name, r["top1_by_step"], r["tau"])
    for row in table:
        if row.name in done:
            log.info("%s: already in %s, skipped", row.name, res_path)
            continue
        log.info("%s: %s", row.name, row.what)
        r = run_row(row, args, model_train, tok, model_eval, prompt_sets)
        r["command"] = command
        with res_path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        results.append(r)
        write_markdown(results, out / "results.md")
        log.info("%s: top-1 %s, tau %s", row.name, r["top1_by_step"], r["tau"])
    write_markdown(results, out / "results.md")
    print(f"wrote {out / 'results.md'} ({len(results)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
