"""Work that runs off the GUI thread: model loading (+ calibration), generation, K sweeps, the batch regime
and lossless checks.

A worker runs on a plain Python thread and never touches Qt. It posts messages `(kind, args)` to its mailbox
(a `queue.SimpleQueue`), and the window hands them to their handlers on its UI tick (`Job.deliver`, through
its job slots, app/jobs.py), so every Qt object is only ever created, used and freed on the GUI thread. The
last message of every worker is `("done", ())`.

Why not QObject workers on QThreads: then the worker thread owns Qt objects and emits signals, and anything
that frees Qt objects there can deadlock Shiboken against the GUI thread. The CI hang of 2026-11-30 was such a
case (a garbage collection on the decoding thread freeing dead menus; app/gc_guard.py keeps collections off
workers). Here a worker holds no Qt object of its own, so its own references never free one on its thread. A
mailbox polled at 40 Hz costs nothing here: the window draws at 20 Hz anyway.
"""
from __future__ import annotations

import copy
import queue
import threading
import traceback
from typing import Callable

from app import gc_guard
from engine.errors import SpecplayError


def error_message(exc: BaseException) -> str:
    """A user-facing message: SpecplayError as is, anything else named as an engine failure."""
    if isinstance(exc, SpecplayError):
        return str(exc)
    return f"The engine failed: {type(exc).__name__}: {exc}"


class Worker:
    """Runs `work()` on the worker thread; a failure becomes a ("failed", message) message, then ("done",).
    `stop()` is thread-safe: the work polls `stop_requested` where it can stop early."""

    def __init__(self):
        self.mailbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()

    def post(self, kind: str, *args) -> None:
        self.mailbox.put((kind, args))

    def stop(self) -> None:
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def work(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        try:
            self.work()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a dialog, never a crash
            if not isinstance(exc, SpecplayError):
                traceback.print_exc()
            self.post("failed", error_message(exc))
        finally:
            self.post("done")


class DecoderWorker(Worker):
    """Uses the decoder on one prompt and config (the decoder polls the stop flag once a round)."""

    def __init__(self, decoder, prompt: str, config):
        super().__init__()
        self.decoder = decoder
        self.prompt = prompt
        self.config = config


class GenerationWorker(DecoderWorker):
    """Iterates decoder.generate(...) and posts one ("event", RoundEvent) per round."""

    def work(self) -> None:
        for event in self.decoder.generate(self.prompt, self.config, should_stop=self._stop.is_set):
            self.post("event", event)


class SweepWorker(DecoderWorker):
    """Measures the speedup of each K on the prompt (engine.bench.suite.steadiest_k_sweep); one ("row", dict)
    per
    K. While the machine's speed moved during a sweep it sweeps again, once: ("again", n) before sweep n,
    and at the end ("steadiest", rows) with the sweep kept."""

    passes = 2

    def __init__(self, decoder, prompt: str, config, ks):
        super().__init__(decoder, prompt, config)
        self.ks = tuple(ks)

    def _report(self, row: dict) -> bool:
        self.post("row", row)
        return not self._stop.is_set()

    def work(self) -> None:
        from engine.bench.suite import steadiest_k_sweep

        rows, swept = steadiest_k_sweep(self.decoder, [self.prompt], self.config, self.ks, passes=self.passes,
                                        progress=self._report, again=lambda n: self.post("again", n))
        if swept > 1:
            self.post("steadiest", rows)


class MethodSweepWorker(DecoderWorker):
    """Measures the given method specs on the prompt, round-robin with plain decoding (engine.bench.suite's
    bench_methods): ("progress", done, total, text) after each generation, then ("rows", rows, complete):
    a stopped sweep posts the methods it measured (none when stopped while warming up)."""

    def __init__(self, decoder, prompt: str, config, specs):
        super().__init__(decoder, prompt, config)
        self.specs = tuple(specs)

    def _report(self, done: int, total: int) -> bool:
        self.post("progress", done, total, "Method sweep: %v of %m generations")
        return not self._stop.is_set()

    def work(self) -> None:
        from engine.bench.suite import bench_methods

        rows = bench_methods(self.decoder, [self.prompt], self.config, self.specs, progress=self._report,
                             keep_partial=True)
        if rows:
            self.post("rows", rows, not self._stop.is_set())


class BatchWorker(DecoderWorker):
    """The batch regime (engine.bench.batch.bench_batch): a BatchDecoder over the loaded decoder's models (no
    reload) decodes the prompt at each batch size, plainly and speculatively; one ("row", BatchRow) per batch
    (the stop flag is read after each, so a stop ends the run after the batch it is measuring), then
    ("report", BatchReport) of the measured batches with the roofline fit."""

    def __init__(self, decoder, prompt: str, config, batches, ks):
        super().__init__(decoder, prompt, config)
        self.batches = tuple(batches)
        self.ks = tuple(ks)

    def _report(self, row) -> bool:
        self.post("row", copy.copy(row))  # the analysis fills in the row's predictions on this thread later
        return not self._stop.is_set()

    def work(self) -> None:
        from engine.bench.batch import bench_batch

        report = bench_batch(batch_decoder(self.decoder), [self.prompt], self.config, self.batches, self.ks,
                             progress=self._report)
        self.post("report", report)


def batch_decoder(decoder):
    """A BatchDecoder sharing the loaded decoder's model pair (weights used as they are), kernels and EAGLE
    head (loaded on first use)."""
    from engine.core.batch import BatchDecoder

    pair = getattr(decoder, "pair", None)
    if pair is None:
        raise SpecplayError("The loaded decoder has no model pair that batched decoding can use.")
    return BatchDecoder(pair, backend=getattr(decoder, "backend", None),
                        eagle_head=getattr(decoder, "eagle_head", None))


class LosslessWorker(DecoderWorker):
    """Checks that the method did not change the output (engine.analysis.lossless): posts ("greedy",
    GreedyReport),
    then ("sampling", ChiSquareReport, or None when stopped) for `sampled_config` over `samples` seeds."""

    def __init__(self, decoder, prompt: str, config, sampled_config, samples: int):
        super().__init__(decoder, prompt, config)
        self.sampled_config = sampled_config
        self.samples = samples

    def work(self) -> None:
        from engine.analysis.lossless import check_greedy, check_sampling

        self.post("greedy", check_greedy(self.decoder, self.prompt, self.config))
        self.post("sampling", check_sampling(self.decoder, self.prompt, self.sampled_config, self.samples,
                                             should_stop=self._stop.is_set, progress=self._seeds_done))

    def _seeds_done(self, done: int, total: int) -> None:
        if done == total or done % max(1, total // 100) == 0:  # at most ~100 messages
            self.post("progress", done, total, "Lossless check: %v of %m seeds")


class LoadWorker(Worker):
    """Loads a decoder with `loader(target, draft, device)`, calibrates it for K and posts
    ("loaded", decoder, calibration); calibration is None when it failed. Loading cannot be interrupted."""

    def __init__(self, loader, target, draft, device: str, k: int, draft_optional: bool = False):
        super().__init__()
        self.loader = loader
        self.args = (target, draft, device)
        self.k = k
        self.draft_optional = draft_optional  # a draft kept from the last pair: dropped if it does not fit

    def work(self) -> None:
        decoder = self._load()
        self.post("progress", 1, 2, "Calibrating: timing one target and one draft step (2 of 2)…")
        self.post("loaded", decoder, self._calibrate(decoder))

    def _load(self):
        """The pair; with draft_optional, the target alone when the draft does not fit it (posts
        ("draft_dropped", draft, why))."""
        target, draft, device = self.args
        if not (self.draft_optional and draft):
            return self.loader(*self.args)
        try:
            return self.loader(target, draft, device)
        except SpecplayError as exc:
            decoder = self.loader(target, None, device)
            self.post("draft_dropped", draft, str(exc))
            return decoder

    def _calibrate(self, decoder):
        try:
            return decoder.calibrate(self.k)
        except Exception:  # noqa: BLE001 - the plots just go without a prediction
            traceback.print_exc()
            return None


class Job:
    """A worker on its own daemon thread, with the GUI-thread handlers of its messages by kind. While it runs,
    the garbage collector stays on the GUI thread (app/gc_guard.py)."""

    def __init__(self, worker: Worker, **handlers: Callable):
        self.worker = worker
        self.handlers = handlers
        self.thread = threading.Thread(target=worker.run, name=type(worker).__name__, daemon=True)
        self._holds_gc = False

    def start(self) -> None:
        gc_guard.hold()
        self._holds_gc = True
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop()

    def deliver(self) -> None:
        """On the GUI thread: hand every waiting message to its handler, in the order they were posted."""
        while True:
            try:
                kind, args = self.worker.mailbox.get_nowait()
            except queue.Empty:
                return
            handler = self.handlers.get(kind)
            if handler is not None:
                handler(*args)

    def finish(self, timeout_s: float = 30.0) -> bool:
        """Join the thread (it ends right after posting "done"). True when it has ended; only then may the
        collector run automatically again."""
        self.thread.join(timeout_s)
        ended = not self.thread.is_alive()
        if ended and self._holds_gc:
            self._holds_gc = False
            gc_guard.release()
        return ended
