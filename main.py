"""specplay: the desktop playground by default; `python main.py --help` lists the headless commands.

Here, and only here, the GUI and the CLI meet: the engine never imports the app."""
from __future__ import annotations

import sys


def _quiet_interrupt(kind, value, traceback, _default=sys.excepthook):
    """A Ctrl+C that lands while this module's own imports run: one word, no traceback."""
    if issubclass(kind, KeyboardInterrupt):
        print("interrupted", file=sys.stderr, flush=True)
    else:
        _default(kind, value, traceback)


sys.excepthook = _quiet_interrupt

import signal  # noqa: E402


class _Signals:
    """Ctrl+C (SIGINT) and SIGTERM from the first instant: each raises KeyboardInterrupt, which the command
    turns into "interrupted" and status 130, and is remembered, so that one swallowed on the way (in a
    library's import, a finaliser) still ends the process with 130 instead of 0."""

    received = False

    @classmethod
    def interrupt(cls, signum, frame):
        cls.received = True
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @classmethod
    def remember(cls, signum, frame):  # once the command is over: nothing left to stop
        cls.received = True


if __name__ == "__main__":  # run as the program (tests that import this module keep their own handlers)
    signal.signal(signal.SIGINT, _Signals.interrupt)
    signal.signal(signal.SIGTERM, _Signals.interrupt)

import os  # noqa: E402 - the handlers first: a signal during the imports is an interruption too
from typing import Optional  # noqa: E402

from engine.errors import SpecplayError  # noqa: E402

EXIT_INTERRUPTED = 130


def wants_gui(argv: list) -> bool:
    """No command, or options only (`main.py --target DIR`): the desktop playground."""
    return not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help")


def launch_gui(args) -> int:
    """The `gui` command: open the window, or say in one line why it cannot open."""
    if getattr(args, "open_trace", None):  # a file that is not a trace: one line and status 2, no window
        from engine.files.trace import read_trace

        read_trace(args.open_trace)
    if sys.platform.startswith("linux") and not any(
            os.environ.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")):
        raise SpecplayError("no display found for the window: run it in a desktop session, or use the "
                            "headless commands (python main.py --help)")
    try:
        from app import backend
        from app.main_window import run_gui
    except ImportError as exc:
        raise SpecplayError(f"the GUI cannot start: {exc}") from None
    backend.THREADS = args.threads
    return run_gui(target=args.target, draft=args.draft, device=args.device,
                   open_trace=getattr(args, "open_trace", None))


def main(argv: Optional[list] = None) -> int:
    try:
        code = _command(argv)
    except KeyboardInterrupt:  # before the command's own handling began, or after it ended
        code = EXIT_INTERRUPTED
        _say_interrupted()
    if __name__ == "__main__":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _Signals.remember)
    if _Signals.received and code != EXIT_INTERRUPTED:  # an interruption something swallowed
        _say_interrupted()
        code = EXIT_INTERRUPTED
    return code


def _command(argv: Optional[list]) -> int:
    from engine.cli import main as cli

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_gui(argv):
        argv = ["gui", *argv]
    return cli.main(argv, gui=launch_gui)


def _say_interrupted() -> None:
    try:
        print("interrupted", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
