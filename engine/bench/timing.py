"""Timing that is honest on CUDA without stalling it.

Stopwatch synchronises at the end of a timed phase: right for timing one step in isolation (calibration).
RoundClock times the phases of a decoding round without a synchronisation between them: a sync per phase would
keep the host from queueing the next phase while the GPU still runs the last one, which costs more than the
phase itself once steps are replayed CUDA graphs.
"""
from __future__ import annotations

import time
from typing import Optional

import torch


class Stopwatch:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.start = time.perf_counter()

    def elapsed_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - self.start) * 1000.0


class RoundClock:
    """Marks phase ends; on CUDA each mark also records an event on the current stream.

    A phase lasts from the previous mark until the GPU has run what the phase queued (the event's time), or
    until the host queued it when the GPU was idle sooner. Read `phases_ms` after a host sync that follows the
    last mark (it waits for the last event, which is then all but always done already). On CPU, work is
    synchronous and the marks are host times."""

    def __init__(self, device: torch.device, calls=None):
        """calls: the generation's engine.kernels.cuda_calls.StreamCalls, which records the events on its
        stream
        (None: torch's events on the current stream). Naming the stream saves the lookup of the current
        stream that each event's record() would make: on an H200's host a made and recorded event took 14 us
        that way, and a plain round's marks 27 of its 214 us of host time
        (docs/measurements/host_cost_gpu.txt)."""
        self.cuda = torch.device(device).type == "cuda"
        self.calls = calls
        self.start = time.perf_counter()
        self.end = None  # host time the round ended (stop), None: still running
        self.marks: list = [self._event()] if self.cuda else [self.start]

    def _event(self):
        if self.calls is not None:
            return self.calls.event()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, event=None) -> None:
        """event: one just recorded on the round's stream (timing on) to serve as this mark, instead of a new
        one (the readout's copy's, recorded right before)."""
        if not self.cuda:
            self.marks.append(time.perf_counter())
        else:
            self.marks.append(event if event is not None else self._event())

    def stop(self, since: Optional[float] = None) -> float:
        """The round's host work is over (what the host does next is the next round's); returns the time.
        since: the previous round's end, when this round was queued before it ended (rounds in flight
        together): this round's host time then starts there, so that rounds never count the same time
        twice."""
        self.end = time.perf_counter()
        if since is not None and since > self.start:
            self.start = since
        return self.end

    def phases_ms(self) -> list:
        """Milliseconds between consecutive marks, then the rest of the round until stop() (or now)."""
        if self.cuda:
            # the readout is read off the device once its copy lands, which can be before the driver has
            # marked the events complete (seen with another process on the GPU: cudaErrorNotReady); the
            # events were recorded in order on one stream, so the last one's completion covers them all
            self.marks[-1].synchronize()
            phases = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        else:
            phases = [(b - a) * 1000.0 for a, b in zip(self.marks, self.marks[1:])]
        total = ((self.end or time.perf_counter()) - self.start) * 1000.0
        return phases + [max(0.0, total - sum(phases))]
