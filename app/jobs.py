"""One slot per kind of background job (model loading, generation, K sweep, lossless check).

A slot holds at most one Job (app.workers): it starts it, hands its messages to their GUI-thread handlers when
the window's UI tick calls `deliver`, asks it to stop, and joins it. When the worker posts its last message
("done"), the slot joins the thread and empties itself before it calls the `done(job)` handler, so the handler
sees an idle slot and may start the next job in it. Workers stay plain threads with a mailbox, and the garbage
collector stays on the GUI thread while one runs (Job.start/finish, app/gc_guard.py). No Qt here.
"""
from __future__ import annotations

from typing import Callable, Optional

from app.workers import Job, Worker


class JobSlot:
    """At most one running Job of one kind; `busy` while it has not been joined."""

    def __init__(self, name: str):
        self.name = name
        self.job: Optional[Job] = None
        self._on_done: Optional[Callable] = None

    @property
    def busy(self) -> bool:
        return self.job is not None

    def start(self, worker: Worker, done: Optional[Callable] = None, **handlers: Callable) -> Job:
        """Run `worker` on its own thread. `handlers` take its messages by kind; `done(job)` runs once it has
        ended and been joined (never when `finish` joined it first, as closing the window does)."""
        if self.job is not None:
            raise RuntimeError(f"the {self.name} slot already runs {type(self.job.worker).__name__}")
        self._on_done = done
        self.job = Job(worker, **handlers, done=self._joined)
        self.job.start()
        return self.job

    def deliver(self) -> None:
        """On the GUI thread: hand the job's waiting messages to their handlers."""
        if self.job is not None:
            self.job.deliver()

    def stop(self) -> bool:
        """Ask the running worker to stop early (thread-safe flag); False when the slot is idle."""
        if self.job is None:
            return False
        self.job.stop()
        return True

    def finish(self, timeout_s: float = 30.0) -> Optional[Job]:
        """Join the job and empty the slot. Returns the job, or None when the slot was idle."""
        job, self.job = self.job, None
        if job is not None:
            job.finish(timeout_s)
        return job

    def _joined(self) -> None:
        on_done, job = self._on_done, self.finish()
        self._on_done = None
        if job is not None and on_done is not None:
            on_done(job)
