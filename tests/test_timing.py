"""RoundClock: phase times without a sync between phases; on CPU the marks are host times."""
import time

import pytest
import torch

from engine.bench.timing import RoundClock


def test_round_clock_phases_cover_the_round():
    clock = RoundClock(torch.device("cpu"))
    time.sleep(0.02)
    clock.mark()
    time.sleep(0.01)
    clock.mark()
    time.sleep(0.005)
    before = time.perf_counter()
    first, second, rest = clock.phases_ms()
    after = time.perf_counter()
    assert first >= 20.0 and second >= 10.0 and rest >= 5.0
    # the phases add up to the round's wall time at the moment they were read
    assert (before - clock.start) * 1000.0 <= first + second + rest <= (after - clock.start) * 1000.0


@pytest.mark.gpu
def test_round_clock_on_cuda_times_queued_work():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    x = torch.randn(2048, 2048, device="cuda")
    clock = RoundClock(torch.device("cuda"))
    for _ in range(20):
        x = x @ x / 2048 ** 0.5
    clock.mark()  # queued, not finished: the event's time is when the GPU got there
    x.sum().item()  # the round's one sync
    gpu_ms, rest = clock.phases_ms()
    assert gpu_ms > 0.0 and rest >= 0.0


def test_round_clock_waits_for_its_last_event_before_reading_them():
    """The readout can land before the driver marks the round's events complete (cudaErrorNotReady under
    another process's load): phases_ms waits for the last event first, then reads every interval."""

    class Event:
        done = False

        def __init__(self, at_ms: float):
            self.at_ms = at_ms

        def synchronize(self) -> None:
            Event.done = True

        def elapsed_time(self, end: "Event") -> float:
            if not Event.done:
                raise RuntimeError("cudaErrorNotReady: device not ready")
            return end.at_ms - self.at_ms

    clock = RoundClock(torch.device("cpu"))
    clock.cuda, clock.marks = True, [Event(0.0), Event(1.5), Event(4.0)]
    draft_ms, verify_ms, _ = clock.phases_ms()
    assert (draft_ms, verify_ms) == (1.5, 2.5) and Event.done
