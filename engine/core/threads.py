"""How many CPU threads torch computes with.

torch starts one intra-op thread per core. For a small model at batch 1 a forward is too short to split:
the threads mostly wait for each other, and a machine with another busy process makes every one of them wait
for a core (on 2 cores beside one CPU-bound process, 20x slower than one thread). So:

- `--threads N` (or the GUI's loader given N) wins;
- else an explicit OMP_NUM_THREADS / MKL_NUM_THREADS in the environment is respected;
- else a small model (under SMALL_MODEL_PARAMS weights) gets one thread, a larger one the physical cores
  this process may run on, less one (left for the GUI, the tokenizer and the rest of the machine).
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

from engine.config import check_int

SMALL_MODEL_PARAMS = 50_000_000
MAX_THREADS = 1024
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_SKIPPED_ATTRS = ("kv", "cache")  # caches, not weights: their size says nothing of the compute per token


def check_threads(threads: Optional[int]) -> None:
    """None (choose) or an integer in 1..MAX_THREADS."""
    if threads is not None:
        check_int("--threads", threads, 1, MAX_THREADS)


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def physical_cores() -> int:
    """Physical cores this process may use: logical CPUs divided by the SMT width /proc/cpuinfo shows."""
    logical = usable_cpus()
    cores, siblings = _cpuinfo_counts()
    if cores and siblings and siblings > cores:
        return max(1, logical * cores // siblings)
    return logical


def _cpuinfo_counts() -> tuple:
    """(cpu cores, siblings) of one package from /proc/cpuinfo, or (0, 0) where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            text = handle.read(1 << 20)
    except OSError:
        return 0, 0
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("cpu cores", "siblings") and value.strip().isdigit():
            values.setdefault(key.strip(), int(value))
    return values.get("cpu cores", 0), values.get("siblings", 0)


def env_threads(environ=None) -> Optional[int]:
    """The thread count an environment variable asks for (OMP_NUM_THREADS first), None when none does."""
    environ = os.environ if environ is None else environ
    for name in ENV_VARS:
        first = environ.get(name, "").split(",")[0].strip()  # OpenMP allows a nested list: "4,2"
        if first.isdigit() and int(first) > 0:
            return min(int(first), MAX_THREADS)
    return None


def choose_threads(params: int, requested: Optional[int] = None, environ=None,
                   cores: Optional[int] = None) -> int:
    """The thread count for a model of `params` weights (see the module's docstring)."""
    check_threads(requested)
    if requested is not None:
        return requested
    from_env = env_threads(environ)
    if from_env is not None:
        return from_env
    if params < SMALL_MODEL_PARAMS:
        return 1
    return max(1, (cores or physical_cores()) - 1)


def count_weights(*runners) -> int:
    """Weights held by the runners (tensors and nn.Modules reachable from their public attributes)."""
    seen: set = set()
    return sum(_weights(r, seen, depth=3) for r in runners if r is not None)


def _weights(obj, seen: set, depth: int) -> int:
    import torch

    if id(obj) in seen or depth < 0:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, torch.nn.Module):
        return sum(_weights(p, seen, 0) for p in obj.parameters())
    if isinstance(obj, (list, tuple)):
        return sum(_weights(item, seen, depth - 1) for item in obj)
    attrs = _public_attrs(obj)
    return sum(_weights(value, seen, depth - 1) for value in attrs)


def _public_attrs(obj) -> Iterable:
    if isinstance(obj, (str, bytes, int, float, bool, dict, type(None))) or not hasattr(obj, "__dict__"):
        return ()
    return [v for k, v in vars(obj).items() if not k.startswith("_") and k not in _SKIPPED_ATTRS]


def apply_threads(runners: Iterable = (), requested: Optional[int] = None) -> int:
    """Set torch's intra-op thread count for these loaded runners; returns the count now in use."""
    import torch

    runners = list(runners)
    threads = choose_threads(count_weights(*runners), requested)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
