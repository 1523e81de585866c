"""What a measurement ran on, recorded beside its figures (bench results, tune profiles and
the benchmark scripts' JSON), so that numbers from different machines are never compared
unknowingly."""

from __future__ import annotations

import os
import platform

__all__ = ["machine_info"]


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
        "platform": platform.platform(), "machine": platform.machine(), "cpu": cpu,
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
        "treespec": __version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
