"""What a measurement ran on, recorded beside its figures (bench results, tune profiles and
the benchmark scripts' JSON), so that numbers from different machines are never compared
unknowingly."""

from __future__ import annotations

import hashlib
import os
import platform

__all__ = ["machine_info", "cpu_id"]


def machine_info() -> dict:
    """Platform, CPU model and count, Python, torch (and its thread count), transformers,
    treespec and the CUDA device, if any, as plain JSON types."""
    import torch
    import transformers

    from . import __version__

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "platform": platform.platform(), "machine": platform.machine(), "cpu": cpu, "cpu_id": cpu_id(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
        "treespec": __version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def cpu_id() -> str | None:
    """What tells two CPUs of one model name apart (cloud VMs name several generations "AMD
    EPYC"): ``/proc/cpuinfo``'s identifying fields (x86: family, model, stepping; Arm: implementer,
    variant, part, revision) and a digest of its flags (Arm: features). None where there is no
    such file or it holds none of them (macOS, Windows: ``cpu`` alone tells the CPU there)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]  # the first processor's block
    except OSError:
        return None
    fields = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in first.splitlines() if ":" in ln)}
    ident = [k for k in _IDENT if k in fields]
    flags = fields.get("flags") or fields.get("Features")
    if not ident and flags is None:
        return None
    digest = hashlib.sha256(" ".join(sorted((flags or "").split())).encode()).hexdigest()[:8]
    return ", ".join([*(f"{k} {fields[k]}" for k in ident), f"flags {digest}"])


# /proc/cpuinfo fields that name a CPU's design and revision: x86's, then Arm's
_IDENT = ("cpu family", "model", "stepping", "CPU implementer", "CPU variant", "CPU part", "CPU revision")
