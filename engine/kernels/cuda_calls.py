"""The round loop's CUDA calls on the host, made straight through CuPy's runtime bindings.

On a small model the GPU runs a round in about 100 us, and the host's calls around it cost as much: each of
torch's wrappers (an event's record, a timing read, a non-blocking copy, a graph's replay) sets the device,
looks up the current stream or checks its state before the one runtime call it makes. `StreamCalls` makes
that one call, on the generation's stream (looked up once), with events made once and handed out in turn.
A machine without CuPy keeps torch's calls; the work queued is the same either way.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch


def _runtime():
    """CuPy's runtime module, or None where CuPy cannot be imported."""
    try:
        from cupy.cuda import runtime
    except Exception:  # noqa: BLE001 - no CuPy (or no CUDA for it): torch's calls
        return None
    return runtime


class RawEvent:
    """A CUDA event made once (timing on), recorded again each time it is handed out: torch.cuda.Event's
    record, synchronize and elapsed_time without its device guard."""

    __slots__ = ("handle", "runtime")

    def __init__(self, runtime, handle: int):
        self.runtime, self.handle = runtime, handle

    def synchronize(self) -> None:
        self.runtime.eventSynchronize(self.handle)

    def elapsed_time(self, end: "RawEvent") -> float:
        """Milliseconds from this event to `end` (both complete)."""
        return self.runtime.eventElapsedTime(self.handle, end.handle)


class StreamCalls:
    """The host's CUDA calls for one generation's stream: events, the readout's copy, graph launches."""

    # events handed out before one comes back: a round records at most 4 and at most 3 rounds are unread
    # (two in flight and the one being queued), so an event is recorded again long after it was read
    EVENTS = 32

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.handle = stream.cuda_stream
        # the runtime's calls go to the thread's current device: a stream of another one keeps torch's calls,
        # which set the device first
        same_device = stream.device.index == torch.cuda.current_device()
        self.runtime = _runtime() if same_device else None
        self._events: list = []
        self._next = 0
        if self.runtime is not None:  # the events go with the calls
            weakref.finalize(self, _destroy_events, self.runtime, self._events)
        # id(graph) -> (graph, its cudaGraphExec_t or None where torch gives none); the graph is held, so its
        # id is never another's
        self._graph_execs: dict = {}

    @property
    def raw(self) -> bool:
        return self.runtime is not None

    def event(self):
        """A timing event recorded on the stream now (a RawEvent, or a torch.cuda.Event without CuPy)."""
        if self.runtime is None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            return event
        if len(self._events) < self.EVENTS:
            event = RawEvent(self.runtime, self.runtime.eventCreate())
            self._events.append(event)
        else:
            event = self._events[self._next]
            self._next = (self._next + 1) % self.EVENTS
        self.runtime.eventRecord(event.handle, self.handle)
        return event

    def copy_to_host(self, host: torch.Tensor, device: torch.Tensor) -> None:
        """Queue device's bytes into the pinned host tensor of the same shape and dtype (contiguous both)."""
        if self.runtime is None or not (host.is_contiguous() and device.is_contiguous()):
            host.copy_(device, non_blocking=True)
            return
        self.runtime.memcpyAsync(host.data_ptr(), device.data_ptr(), device.numel() * device.element_size(),
                                 self.runtime.memcpyDeviceToHost, self.handle)

    def copy_to_device(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """Queue the pinned host tensor's bytes into the device tensor of the same shape and dtype (contiguous
        both). The host buffer must stay untouched until the copy ran (callers hand out buffers in turn)."""
        if self.runtime is None or not (host.is_contiguous() and device.is_contiguous()):
            device.copy_(host, non_blocking=True)
            return
        self.runtime.memcpyAsync(device.data_ptr(), host.data_ptr(), host.numel() * host.element_size(),
                                 self.runtime.memcpyHostToDevice, self.handle)

    def launch(self, graph: torch.cuda.CUDAGraph) -> None:
        """Replay a captured graph on the stream. The raw launch skips torch's replay prologue, which only
        advances the offsets of torch's device generators: the round's graphs draw no random numbers on
        the device (their uniforms come from the run's CPU generator, copied in)."""
        held = self._graph_execs.get(id(graph))
        if held is None:
            held = self._graph_execs[id(graph)] = (graph, self._graph_exec(graph))
        handle = held[1]
        if handle is None:
            with torch.cuda.stream(self.stream):
                graph.replay()
            return
        self.runtime.graphLaunch(handle, self.handle)

    def _graph_exec(self, graph: torch.cuda.CUDAGraph) -> Optional[int]:
        if self.runtime is None or not hasattr(graph, "raw_cuda_graph_exec"):
            return None
        try:
            handle = int(graph.raw_cuda_graph_exec())
        except (RuntimeError, TypeError, ValueError):
            return None
        return handle or None


def _destroy_events(runtime, events: list) -> None:
    for event in events:
        try:
            runtime.eventDestroy(event.handle)
        except Exception:  # noqa: BLE001 - at exit the context may be gone already
            pass


def stream_calls(current: Optional[StreamCalls], stream: torch.cuda.Stream) -> StreamCalls:
    """current when it serves this stream already (its events and graph handles kept), else a new one."""
    if current is not None and current.handle == stream.cuda_stream:
        return current
    return StreamCalls(stream)
