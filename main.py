"""specplay: the desktop playground by default; `python main.py --help` lists the headless commands.

Here, and only here, the GUI and the CLI meet: the engine never imports the app."""
from __future__ import annotations

import os
import sys
from typing import Optional

from engine import cli
from engine.errors import SpecplayError


def wants_gui(argv: list) -> bool:
    """No command, or options only (`main.py --target DIR`): the desktop playground."""
    return not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help")


def launch_gui(args) -> int:
    """The `gui` command: open the window, or say in one line why it cannot open."""
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
    return run_gui(target=args.target, draft=args.draft, device=args.device)


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_gui(argv):
        argv = ["gui", *argv]
    return cli.main(argv, gui=launch_gui)


if __name__ == "__main__":
    sys.exit(main())
