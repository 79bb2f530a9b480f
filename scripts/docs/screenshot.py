"""Save screenshots of the real window for the README (docs/): the middle of a generation
(docs/screenshot.png), a tree method with its Draft tree panel (docs/screenshot-tree.png), a comparison of
runs (docs/screenshot-compare.png) and, where the window has one, the diagnosis view
(docs/screenshot-diagnosis.png).

    python scripts/docs/screenshot.py                          # shipped models, else tiny random ones
    python scripts/docs/screenshot.py --target DIR --draft DIR --out-dir docs --only mid

Runs offscreen when there is no display; uses throwaway settings, never the user's.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEFAULT_PROMPT = 'def read_config(path):\n    """Load a JSON config file and return it as a dict."""'
SHOTS = {"mid": "screenshot.png", "tree": "screenshot-tree.png", "compare": "screenshot-compare.png",
         "diagnosis": "screenshot-diagnosis.png"}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target model folder (default: the shipped pair)")
    parser.add_argument("--draft", help="draft model folder")
    parser.add_argument("--tiny", action="store_true", help="tiny random models even if shipped ones exist")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out-dir", default=str(ROOT / "docs"))
    parser.add_argument("--only", choices=tuple(SHOTS), action="append",
                        help="make only this screenshot (repeatable; default: all)")
    parser.add_argument("--tree-method", default="medusa", help="the tree method of screenshot-tree.png")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--method", default="draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=24, help="grab after this many rounds")
    parser.add_argument("--theme", choices=("system", "light", "dark"), default="light")
    parser.add_argument("--size", default="1400x900", help="window size WxH")
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
        from engine.models.loading import shipped_pair

        try:
            shipped_pair()
            return None, None
        except SpecplayError:
            print("no shipped models: using tiny random ones", file=sys.stderr)
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_pair

    target, draft = make_tiny_pair(scratch / "tiny")
    return str(target), str(draft)


def open_window(args, app, scratch):
    from app.main_window import MainWindow

    target, draft = pick_models(args, scratch)
    window = MainWindow(device=args.device)
    window.show_error = lambda title, message: print(f"{title}: {message}", file=sys.stderr)
    width, height = (int(v) for v in args.size.split("x"))
    window.resize(width, height)
    window.apply_theme(args.theme)
    window.show()
    window.start(target, draft)
    if not wait_until(app, lambda: window.load_job is None, 300) or window.decoder is None:
        return None
    window.max_tokens.setValue(args.max_new_tokens)
    window.prompt.setPlainText(args.prompt)
    return window


def run_to(app, window, method: str, k: int, rounds=None) -> None:
    """Generate with method and K; wait for `rounds` rounds (None: the end)."""
    window.set_method(method)
    window.set_k(k)
    window.generate()
    if rounds is None:
        wait_until(app, lambda: not window.running, 600)
    else:
        wait_until(app, lambda: window.current is None or len(window.current.events) >= rounds, 300)


def pin_a_draft(window) -> None:
    """Click the last drafted token so the inspector has something."""
    tokens = window.view.tokens
    if tokens:
        window._show_token(next((t for t in reversed(tokens) if t.depth is not None), tokens[-1]))


def pixels(window):
    """The window as the screen shows it (under a real display: the tab bars of tabbed docks as they are;
    QWidget.grab painted a stale one over the docks); offscreen, as it paints itself."""
    from PySide6.QtGui import QGuiApplication

    if QGuiApplication.platformName() == "offscreen":
        return window.grab()
    return window.screen().grabWindow(window.winId())


def save(app, window, path: Path) -> bool:
    window.statusBar().clearMessage()
    window.plots.redraw()
    wait_until(app, lambda: False, 0.4)  # let the paints land
    ok = pixels(window).save(str(path))
    print(f"wrote {path}" if ok else f"could not write {path}")
    return ok


def shot_mid(app, window, args, path) -> bool:
    run_to(app, window, args.method, args.k, args.rounds)
    pin_a_draft(window)
    ok = save(app, window, path)
    window.stop()
    wait_until(app, lambda: not window.running, 60)
    return ok


def shot_tree(app, window, args, path) -> bool:
    if window.availability.get(args.tree_method.split(":")[0]) is not None:
        print(f"{args.tree_method} is not available on these models: no tree screenshot", file=sys.stderr)
        return True
    run_to(app, window, args.tree_method, args.k, args.rounds)
    window.tree_dock.raise_()  # the Draft tree tab, across the window where the plots were
    ok = save(app, window, path)
    window.plots_dock.raise_()
    window.stop()
    wait_until(app, lambda: not window.running, 60)
    return ok


def shot_compare(app, window, args, path) -> bool:
    window.max_tokens.setValue(min(args.max_new_tokens, 96))
    first = window.history.count()
    run_to(app, window, "none", args.k)
    for _ in range(2):
        run_to(app, window, args.method, args.k)
    run_to(app, window, "ngram", args.k)
    window.compare_rows(list(range(first, window.history.count())))
    window.history.setCurrentRow(first + 1)
    window.compare_rows(list(range(first, window.history.count())))
    window.compare_dock.show()
    window.compare_dock.raise_()  # the Compare tab of the right column, the plots below with the overlays
    return save(app, window, path)


def shot_diagnosis(app, window, args, path) -> bool:
    dock = getattr(window, "diagnosis_dock", None)
    if dock is None:
        print("this window has no diagnosis view: no diagnosis screenshot", file=sys.stderr)
        return True
    dock.show()
    dock.raise_()  # the Why is it slow? tab, beside the comparison's plots
    wait_until(app, lambda: not getattr(window, "diagnosing", False), 10.0)  # made off the GUI thread
    return save(app, window, path)


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

    preload_engine()
    window = open_window(args, app, scratch)
    if window is None:
        print("models did not load", file=sys.stderr)
        return 1
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    makers = {"mid": shot_mid, "tree": shot_tree, "compare": shot_compare, "diagnosis": shot_diagnosis}
    ok = all(makers[name](app, window, args, out / SHOTS[name]) for name in (args.only or SHOTS))
    window.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
