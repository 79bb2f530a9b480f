"""Work that runs off the GUI thread: model loading (+ calibration) and generation.

Each worker is a QObject moved to its own QThread; results reach the window as queued signals, so the window
only ever touches Qt objects on the GUI thread. `Job` keeps a worker and its thread together.
"""
from __future__ import annotations

import threading
import traceback

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.errors import SpecplayError


def error_message(exc: BaseException) -> str:
    """A user-facing message: SpecplayError as is, anything else named as an engine failure."""
    if isinstance(exc, SpecplayError):
        return str(exc)
    return f"The engine failed: {type(exc).__name__}: {exc}"


class DecoderWorker(QObject):
    """Runs `work()` on a decoder for one prompt and config; any failure becomes `failed(message)`, then `done`.
    `stop()` is thread-safe: the work polls it (the decoder once a round, a K sweep once a K)."""

    failed = Signal(str)
    done = Signal()

    def __init__(self, decoder, prompt: str, config):
        super().__init__()
        self.decoder = decoder
        self.prompt = prompt
        self.config = config
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def work(self) -> None:
        raise NotImplementedError

    @Slot()
    def run(self) -> None:
        try:
            self.work()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a dialog, never a crash
            if not isinstance(exc, SpecplayError):
                traceback.print_exc()
            self.failed.emit(error_message(exc))
        finally:
            self.done.emit()


class GenerationWorker(DecoderWorker):
    """Iterates decoder.generate(...) and emits one `event` per RoundEvent."""

    event = Signal(object)

    def work(self) -> None:
        for event in self.decoder.generate(self.prompt, self.config, should_stop=self._stop.is_set):
            self.event.emit(event)


class SweepWorker(DecoderWorker):
    """Measures the speedup of each K on the prompt (engine.bench.bench_k_sweep); one `row` per K."""

    row = Signal(object)

    def __init__(self, decoder, prompt: str, config, ks):
        super().__init__(decoder, prompt, config)
        self.ks = tuple(ks)

    def _report(self, row: dict) -> bool:
        self.row.emit(row)
        return not self._stop.is_set()

    def work(self) -> None:
        from engine.bench import bench_k_sweep

        bench_k_sweep(self.decoder, [self.prompt], self.config, self.ks, progress=self._report)


class LoadWorker(QObject):
    """Loads a decoder with `loader(target, draft, device)` and calibrates it for K."""

    loaded = Signal(object, object)  # decoder, calibration (None when calibration failed)
    failed = Signal(str)
    done = Signal()

    def __init__(self, loader, target, draft, device: str, k: int):
        super().__init__()
        self.loader = loader
        self.args = (target, draft, device)
        self.k = k

    def stop(self) -> None:
        """Loading cannot be interrupted; closing the window waits for it."""

    @Slot()
    def run(self) -> None:
        try:
            decoder = self.loader(*self.args)
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, SpecplayError):
                traceback.print_exc()
            self.failed.emit(error_message(exc))
        else:
            self.loaded.emit(decoder, self._calibrate(decoder))
        finally:
            self.done.emit()

    def _calibrate(self, decoder):
        try:
            return decoder.calibrate(self.k)
        except Exception:  # noqa: BLE001 - the plots just go without a prediction
            traceback.print_exc()
            return None


class Job:
    """A worker running in its own thread. `finish()` (on done) joins the thread so it can be dropped."""

    def __init__(self, worker: QObject):
        self.worker = worker
        self.thread = QThread()
        worker.moveToThread(self.thread)
        self.thread.started.connect(worker.run)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop()

    def finish(self, timeout_ms: int = 30000) -> bool:
        self.thread.quit()
        return self.thread.wait(timeout_ms)
