"""How many CPU threads torch should use here, and whether other processes keep the cores busy.

torch runs one thread per core by default, and its threads wait on each other at every
operation: when other processes hold the cores, each wait stretches to a scheduler time
slice, and two threads on two busy cores run many times slower than one (README, "Threads",
has the measurement; issue 50: 10.3 tok/s on 2 threads, 37.5 on one, at a load of 5-6 on 2
cores). So the command line's default (:func:`choose_threads`) takes the cores the load leaves
free, at least one. Imports nothing heavy: the command line asks before torch is loaded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["available_cpus", "physical_cores", "default_threads", "busy_cores", "busy_warning", "choose_threads"]


def available_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity mask, e.g. under taskset or a
    container's cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return list(range(os.cpu_count() or 1))


def _cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs a cgroup v2 quota allows (``cpu.max`` "200000 100000" -> 2), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, -(-int(quota) // int(period)))


def physical_cores(cpus: list[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Physical cores among ``cpus`` (default: :func:`available_cpus`): hyperthread siblings
    share a core and count once. Falls back to the CPU count where the topology is unknown."""
    cpus = available_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topo = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def default_threads() -> int:
    """torch threads to use when the user names none: ``$OMP_NUM_THREADS`` where set (as torch
    itself reads it), else one per physical core this process may use, within a cgroup quota."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    n = physical_cores()
    limit = _cgroup_cpu_limit()
    return max(1, min(n, limit) if limit else n)


def _cpu_times(cpus: list[int], stat: Path) -> dict[int, tuple[int, int]]:
    """``{cpu: (idle, total)}`` jiffies from /proc/stat for ``cpus``."""
    times = {}
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            times[int(name[3:])] = (values[3] + values[4], sum(values))
    return times


def busy_cores(cpus: list[int] | None = None, sample: float = 0.2, stat: Path = Path("/proc/stat")) -> float:
    """Cores of ``cpus`` (default: :func:`available_cpus`) that other work keeps busy: the
    smaller of the 1-minute load average and the busy share measured over ``sample`` seconds
    now. Both must agree: the load average alone still counts a run that just ended, the
    sample alone a passing spike. 0 where the system says neither."""
    cpus = available_cpus() if cpus is None else cpus
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    try:
        before = _cpu_times(cpus, stat)
        time.sleep(sample)
        after = _cpu_times(cpus, stat)
    except (OSError, ValueError):
        return load
    now = 0.0
    for cpu, (idle, total) in after.items():
        if cpu in before and total > before[cpu][1]:
            now += 1 - (idle - before[cpu][0]) / (total - before[cpu][1])
    return min(load, now)


def busy_warning(threads: int, cores: int | None = None, load: float | None = None) -> str | None:
    """A warning when ``threads`` torch threads will compete with other processes for the
    cores (the load average leaves fewer than ``threads`` of them free), else None."""
    if threads <= 1:
        return None
    cores = default_threads() if cores is None else cores
    load = busy_cores() if load is None else load
    free = max(cores - load, 0.0)
    if threads <= free + 0.5:
        return None
    return (f"other processes keep about {load:.1f} of {cores} core(s) busy: {threads} torch threads would "
            f"wait on each other; if generation is slow, try --threads {max(1, round(free))} "
            f"(README: Threads)")


def choose_threads(cores: int | None = None, load: float | None = None) -> tuple[int, str | None]:
    """``(threads, note)``: the torch threads to use when the user names none, and one line
    saying why when they are fewer than :func:`default_threads`. ``$OMP_NUM_THREADS`` is the
    user's choice and stays; otherwise, when other processes keep the cores busy (the load, by
    :func:`busy_cores`, leaves fewer free than there are cores, within half a core; the rule
    of :func:`busy_warning`), the free cores, at least one: on 2 cores, one once more than half
    a core is busy."""
    cores = default_threads() if cores is None else cores
    if cores <= 1 or os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return cores, None
    load = busy_cores() if load is None else load
    free = max(cores - load, 0.0)
    if cores <= free + 0.5:
        return cores, None
    n = max(1, min(cores - 1, round(free)))
    return n, (f"other processes keep about {load:.1f} of {cores} cores busy: using {n} torch thread(s), not "
               f"{cores}, as threads on busy cores wait on each other (--threads N overrides; README: Threads)")
