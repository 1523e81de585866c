"""llama.cpp beside a `treespec bench` run: on exactly that run's prompts (the same token
ids) and token budget, with its threads, greedy; its rows added to the run's report (JSON and
.txt, and the plots where asked). README.md in this folder says how to install and what it
measured.

    python benchmarks/peers/run.py --bench REPORT.json [--out REPORT.json] [--venv DIR] [--plot-dir DIR]

Run it from the folder the bench ran in (the report's command names its dataset relative to
it). Steps: the bench's own arguments are read back from the report's command; its prompts
are encoded again with the target's tokenizer and checked against the report's lengths; HF
generate's tokens come from the bench's journal where it was kept (``--journal``), else from
HF generate run again here, untimed; llama.cpp then runs in its own environment (created on
first use: llama-cpp-python is built from source, about 25 minutes on 2 cores), one process a
turn, plain and with its prompt lookup; the rows are merged and the report rewritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.peers.peer_rows import PeerRun, PeerSettings, llama_names, llama_request, merge_peers  # noqa: E402
from treespec.cli.common import generation_options, portable  # noqa: E402  (no torch: argparse helpers)

LLAMA_VERSION = "0.3.36"  # measured in issue 48 (facts.md, section 9)
HERE = Path(__file__).resolve().parent


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bench", required=True, help="a treespec bench report (JSON), greedy")
    p.add_argument("--out", default=None, help="where the report with peer rows goes, .json and .txt (default: "
                                               "--bench, rewritten)")
    p.add_argument("--venv", default=None, help="llama-cpp-python's environment, created here if absent (default: "
                                                f"TREESPEC_CACHE/peers/llama-cpp-python-{LLAMA_VERSION})")
    p.add_argument("--gguf", default=None, help="the GGUF llama.cpp runs (default: the bench's model's own: a named "
                                                "model's file in treespec's cache, or a .gguf --model)")
    p.add_argument("--lookup-tokens", type=int, default=3, metavar="K",
                   help="llama.cpp+lookup's LlamaPromptLookupDecoding(num_pred_tokens=K); 0: plain only (default 3)")
    p.add_argument("--repack", action="store_true",
                   help="let llama.cpp repack the weights (its AMX path; it crashed on multi-token batches on a "
                        "Sapphire Rapids, so off by default)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed generate per configuration")
    p.add_argument("--no-hf-compare", action="store_true",
                   help="do not run HF generate again for its tokens when the bench kept no journal")
    p.add_argument("--plot-dir", default=None, help="redraw the report's PNGs, peers included, into this folder")
    p.add_argument("--plot-prefix", default=None, help="file name prefix of the PNGs (default: the --out stem and -)")
    return p.parse_args(argv)


def main(argv=None, run_peer=None) -> int:
    """``run_peer(request) -> result`` runs the engine (default: `llama_peer.py` in the
    environment); tests give a fake."""
    args = parse(argv)
    if args.lookup_tokens < 0:
        raise SystemExit(f"error: --lookup-tokens must be >= 0, got {args.lookup_tokens}")
    data = json.loads(Path(args.bench).read_text())
    bench = bench_args(data)
    model, tok, prompts = bench_inputs(data, bench)
    hf = None if args.no_hf_compare and not _journal(bench) else hf_tokens(data, bench, model, tok, prompts)
    s = PeerSettings(max_new_tokens=data["settings"]["max_new_tokens"], threads=data["machine"]["torch_threads"],
                     eos_token_ids=_eos_ids(model), lookup_tokens=args.lookup_tokens, repack=args.repack,
                     warmup=not args.no_warmup)
    del model
    gguf = gguf_path(args.gguf, bench.model)
    if run_peer is None:
        run_peer = llama_runner(ensure_venv(Path(args.venv) if args.venv else _default_venv()), args.repack)
    engine, runs = run_rounds(prompts, tok, str(gguf), s, run_peer)
    command = "python benchmarks/peers/run.py " + shlex.join(portable(a) for a in (argv or sys.argv[1:]))
    data = merge_peers(data, engine, runs, hf, command=command)
    write(Path(args.out or args.bench), data, bench.wide, args.plot_dir, args.plot_prefix)
    return 0


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


def gguf_path(given: str | None, model: str) -> Path:
    """--gguf, else the bench model's own GGUF: a .gguf --model, or a named model's file in
    treespec's cache (fetched as treespec fetches it)."""
    from treespec.models import MODELS

    if given:
        path = Path(given).expanduser()
    elif model.endswith(".gguf"):
        path = Path(model)
    elif model in MODELS:
        path = MODELS[model].locate(None)
    else:
        raise SystemExit(f"error: llama.cpp runs a GGUF and the bench's model {model!r} is none: give --gguf PATH")
    if not path.is_file():
        raise SystemExit(f"error: no GGUF at {path}")
    return path


def run_rounds(prompts, tok, gguf: str, s: PeerSettings, run_peer) -> tuple[dict, dict[str, list[PeerRun]]]:
    """Every configuration on every prompt, one engine process a turn: turn t+1 of a
    conversation is templated after that configuration's own answers (as the bench does),
    its tokens and seconds added to the earlier turns'."""
    names = llama_names(s)
    answers = {n: [[] for _ in prompts] for n in names}  # each prompt's answers, turn by turn
    seconds = {n: [0.0] * len(prompts) for n in names}
    result = None
    for t in range(max(p.num_turns for p in prompts)):
        ids = {i: {n: list(p.ids) if t == 0 else p.next_turn(tok, answers[n][i]) for n in names}
               for i, p in enumerate(prompts) if p.num_turns > t}
        result = run_peer(llama_request(gguf, s, ids, list(prompts[0].ids)))
        for n in names:
            for r in result["runs"][n]:
                answers[n][r["index"]].append(r["tokens"])
                seconds[n][r["index"]] += r["seconds"]
    runs = {n: [PeerRun([x for a in answers[n][i] for x in a], seconds[n][i], [len(a) for a in answers[n][i]])
                for i in range(len(prompts))] for n in names}
    return engine_info(result, s, gguf), runs


def engine_info(result: dict, s: PeerSettings, gguf: str) -> dict:
    """What the rows say of the engine: version, settings and a line per configuration."""
    plain, *rest = llama_names(s)
    base = (f"llama.cpp ({result['version']}) on {Path(gguf).name}, {result['threads']} thread(s), repacked weights "
            f"{result['repack']}")
    descriptions = {plain: base + ", greedy"}
    for n in rest:
        descriptions[n] = (base + f", greedy with its prompt lookup (LlamaPromptLookupDecoding, {s.lookup_tokens} "
                           "tokens, n-grams up to 2)")
    settings = {"gguf": Path(gguf).name, "threads": result["threads"], "repack": result["repack"],
                "lookup_tokens": s.lookup_tokens, "system_info": result.get("system_info")}
    return {"engine": result["engine"], "version": result["version"], "settings": settings,
            "descriptions": descriptions}


def llama_runner(python: Path, repack: bool):
    """``run(request) -> result``: `llama_peer.py` in the environment's python, on files."""
    def run(request: dict) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
            req.write_text(json.dumps(request))
            rc = subprocess.run([str(python), str(HERE / "llama_peer.py"), str(req), str(res)]).returncode
            if rc != 0:
                why = f"died of signal {-rc}" if rc < 0 else f"exited with status {rc}"
                hint = (" (llama.cpp's repacked weights crashed in decode on multi-token batches on a Sapphire "
                        "Rapids: run without --repack)" if repack and rc < 0 else "")
                raise SystemExit(f"error: the llama.cpp peer {why}{hint}")
            return json.loads(res.read_text())
    return run


def _default_venv() -> Path:
    from treespec.models import cache_dir

    return cache_dir() / "peers" / f"llama-cpp-python-{LLAMA_VERSION}"


def ensure_venv(venv: Path) -> Path:
    """The environment's python, the environment created first where absent: a venv and
    llama-cpp-python built from source for this CPU (about 25 minutes on 2 cores)."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"peers: creating {venv}: building llama-cpp-python=={LLAMA_VERSION} from source with "
              "CMAKE_ARGS=-DGGML_NATIVE=ON (about 25 minutes on 2 cores)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", f"llama-cpp-python=={LLAMA_VERSION}"], check=True,
                       env={**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON"})
    if subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        raise SystemExit(f"error: {python} cannot import llama_cpp: remove {venv} to build it again, or "
                         f"install llama-cpp-python=={LLAMA_VERSION} into it")
    return python


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
