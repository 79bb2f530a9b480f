"""Save a screenshot of the real window in the middle of a generation (used for docs/screenshot.png).

    python scripts/screenshot.py                          # shipped models, else tiny random ones
    python scripts/screenshot.py --target DIR --draft DIR --out docs/screenshot.png

Runs offscreen when there is no display; uses throwaway settings, never the user's.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_PROMPT = 'def read_config(path):\n    """Load a JSON config file and return it as a dict."""\n'


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target model folder (default: the shipped pair)")
    parser.add_argument("--draft", help="draft model folder")
    parser.add_argument("--tiny", action="store_true", help="tiny random models even if shipped ones exist")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshot.png"))
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--method", default="draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=24, help="grab after this many rounds")
    parser.add_argument("--theme", choices=("system", "light", "dark"), default="light")
    parser.add_argument("--size", default="1500x950", help="window size WxH")
    return parser.parse_args()


def wait_until(app, condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        app.processEvents()
        time.sleep(0.005)
    return True


def pick_models(args, scratch: Path):
    """(target, draft): as given, else the shipped pair (None, None), else a tiny random pair."""
    if args.target or args.draft:
        return args.target, args.draft
    if not args.tiny:
        from engine.errors import SpecplayError
        from engine.models import shipped_pair

        try:
            shipped_pair()
            return None, None
        except SpecplayError:
            print("no shipped models: using tiny random ones", file=sys.stderr)
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_pair

    target, draft = make_tiny_pair(scratch / "tiny")
    return str(target), str(draft)


def main() -> int:
    args = parse_args()
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    scratch = Path(tempfile.mkdtemp(prefix="specplay-shot-"))

    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(sys.argv)
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(scratch / "settings"))
    from app.backend import preload_engine
    from app.main_window import MainWindow

    preload_engine()
    target, draft = pick_models(args, scratch)
    window = MainWindow(device=args.device)
    window.show_error = lambda title, message: print(f"{title}: {message}", file=sys.stderr)
    width, height = (int(v) for v in args.size.split("x"))
    window.resize(width, height)
    window.apply_theme(args.theme)
    window.show()
    window.start(target, draft)
    if not wait_until(app, lambda: window.load_job is None, 300) or window.decoder is None:
        print("models did not load", file=sys.stderr)
        return 1
    window.set_method(args.method)
    window.set_k(args.k)
    window.max_tokens.setValue(args.max_new_tokens)
    window.prompt.setPlainText(args.prompt)
    window.generate()
    wait_until(app, lambda: window.current is None or len(window.current.events) >= args.rounds, 300)
    shown = window.shown
    if shown is not None and shown.events:  # click the last drafted token so the inspector has something
        window._show_token(next((t for t in reversed(window.view.tokens) if t.depth is not None),
                                window.view.tokens[-1]))
    window.plots.redraw()
    wait_until(app, lambda: False, 0.3)  # let the paints land
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    ok = window.grab().save(args.out)
    window.close()
    print(f"wrote {args.out}" if ok else f"could not write {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
