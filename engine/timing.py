"""Wall-clock timing that is honest on CUDA (synchronises at the end of a timed phase)."""
from __future__ import annotations

import time

import torch


class Stopwatch:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.start = time.perf_counter()

    def elapsed_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - self.start) * 1000.0

    def restart(self) -> float:
        """Elapsed ms, then start a new phase."""
        elapsed = self.elapsed_ms()
        self.start = time.perf_counter()
        return elapsed
