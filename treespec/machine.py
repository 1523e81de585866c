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
    EPYC"): ``/proc/cpuinfo``'s family, model and stepping and a digest of its flags, or None
    where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]  # the first processor's block
    except OSError:
        return None
    fields = dict(ln.split(":", 1) for ln in first.splitlines() if ":" in ln)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if not any(k in fields for k in ("cpu family", "model", "flags")):
        return None
    flags = hashlib.sha256(" ".join(sorted(fields.get("flags", "").split())).encode()).hexdigest()[:8]
    return (f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')} "
            f"stepping {fields.get('stepping', '?')} flags {flags}")
