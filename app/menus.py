"""The window's menu bar. `Menus` builds it from the window's commands and keeps the actions the window
checks, enables and disables. The Method menu's entries come from the method registry
(engine.methods.registry.MENU_SPECS), keyed by their spec string ('draft', 'eagle:8')."""
from __future__ import annotations

from typing import Optional

from PySide6.QtGui import QActionGroup, QKeySequence

from engine.methods.registry import MENU_SPECS, parse_spec

K_CHOICES = range(1, 17)
THEMES = (("system", "Follow the system"), ("light", "Light"), ("dark", "Dark"))
SYNTHETIC_TEXT = "Synthetic acceptance for sweeps…"
SYNTHETIC_TIP = ("A timing study: the K and method sweeps and the batch regime accept as a given profile "
                 "(a mean length L, or rates p1,p2,…) says, not as the target does; their results say "
                 "SYNTHETIC")
UNOFFERED = "not offered by the engine"  # a menu entry whose method the loaded decoder does not list


def command(menu, text: str, slot, shortcut, tip: str = ""):
    """A menu entry that runs `slot`, with its shortcut (a key string or a QKeySequence) and tooltip."""
    action = menu.addAction(text, slot)
    action.setShortcut(shortcut)
    if tip:
        action.setToolTip(tip)
    return action


def spec_text(spec: str) -> str:
    """The menu label of a method spec ('EAGLE, dynamic tree of 8 nodes')."""
    return parse_spec(spec).label


class Menus:
    """Builds the menu bar of `window`, whose methods the actions trigger. `view_actions` are the docks'
    show/hide actions; `sweep_ks` the Ks that "Find the fastest K" measures (for its tooltip)."""

    def __init__(self, window, view_actions: list, sweep_ks: tuple):
        self.window = window
        bar = window.menuBar()
        self._method_menu(bar.addMenu("&Method"))
        self._k_menu(bar.addMenu("&K"), sweep_ks)
        self._sampling_menu(bar.addMenu("&Sampling"))
        self._models_menu(bar.addMenu("M&odels"))
        self._session_menu(bar.addMenu("S&ession"))
        self._view_menu(bar.addMenu("&View"), view_actions)
        help_menu = bar.addMenu("&Help")
        help_menu.addAction("Help: views, numbers, methods, shortcuts…", window.show_help).setShortcut(
            QKeySequence.HelpContents)

    def _method_menu(self, menu) -> None:
        w = self.window
        menu.setToolTipsVisible(True)
        self.method_group = QActionGroup(w)
        self.method_actions = {}
        for number, spec in enumerate(MENU_SPECS, 1):
            action = menu.addAction(spec_text(spec))
            if number <= 9:  # Ctrl+1 plain decoding, Ctrl+2 draft model, ... (one digit each)
                action.setShortcut(f"Ctrl+{number}")
            action.setCheckable(True)
            action.setData(spec)
            action.triggered.connect(lambda _=False, s=spec: w.set_method(s))
            self.method_group.addAction(action)
            self.method_actions[spec] = action
        menu.addSeparator()
        self.check_action = command(menu, "Check lossless…", w.check_lossless, "Ctrl+L",
                                    "Prove on the prompt that the method did not change the output; "
                                    "Esc stops")
        self.method_sweep_action = command(menu, "Find the fastest method…", w.find_fastest_method,
                                           "Ctrl+M", "Measure every method above that the models can run "
                                           "on the prompt, beside plain decoding, at this K and sampling; "
                                           "Esc stops")

    def _k_menu(self, menu, sweep_ks: tuple) -> None:
        w = self.window
        group = QActionGroup(w)
        self.k_actions = {}
        for k in K_CHOICES:
            action = menu.addAction(f"K = {k}")
            action.setCheckable(True)
            action.triggered.connect(lambda _=False, value=k: w.set_k(value))
            group.addAction(action)
            self.k_actions[k] = action
        menu.addSeparator()
        # the shortcuts are the window's (they work wherever the focus is); the menu names them
        self.k_up_action = menu.addAction("Larger K\tCtrl+]", lambda: w.step_k(1))
        self.k_down_action = menu.addAction("Smaller K\tCtrl+[", lambda: w.step_k(-1))
        menu.addSeparator()
        ks = ", ".join(map(str, sweep_ks))
        self.sweep_action = command(menu, "Find the fastest K…", w.find_fastest_k, "Ctrl+K",
                                    f"Measure K = {ks} on the prompt; Esc stops")
        self.batch_action = command(menu, "Batch regime…", w.batch_regime, "Ctrl+B",
                                    "Measure the speedup against the batch size beside the roofline's "
                                    "prediction; Esc stops after the batch it is measuring")
        self.synthetic_action = menu.addAction(SYNTHETIC_TEXT, w.set_synthetic_acceptance)
        self.synthetic_action.setToolTip(SYNTHETIC_TIP)
        self.recalibrate_action = menu.addAction("Recalibrate costs", w.recalibrate)
        self.recalibrate_action.setToolTip("Time the verification curve, draft steps and overhead again")

    def _sampling_menu(self, menu) -> None:
        self.greedy_action = menu.addAction("Greedy")
        self.greedy_action.setShortcut("Ctrl+G")
        self.greedy_action.setCheckable(True)
        self.greedy_action.triggered.connect(self.window.set_greedy)
        menu.addAction("Temperature, top-k, top-p, seed…", self.window.edit_sampling)

    def _models_menu(self, menu) -> None:
        w = self.window
        self.model_actions = [
            menu.addAction("Open target folder…", w.open_target_folder),
            menu.addAction("Open draft folder…", w.open_draft_folder),
            menu.addAction("Back to the shipped pair", w.use_shipped_pair),
            menu.addAction("Connect to a server…", w.connect_to_server),
        ]
        menu.addSeparator()
        self.heads_action = menu.addAction("Open draft heads…", w.open_draft_heads)
        self.heads_action.setToolTip("Published EAGLE, EAGLE-3 or Medusa heads (a folder or a cached Hub id) "
                                     "onto the loaded target: their layout, target, taps and vocabulary")
        self.doctor_action = menu.addAction("Head doctor…", w.head_doctor)
        self.doctor_action.setToolTip("Why do the heads accept less than expected? Acceptance by draft "
                                      "position under each convention their config leaves open")
        self.model_actions += [self.heads_action, self.doctor_action]

    def _session_menu(self, menu) -> None:
        w = self.window
        self.open_trace_action = command(menu, "Open trace…", lambda: w.open_trace(), QKeySequence.Open)
        self.repeat_action = command(menu, "Run N times…", lambda: w.run_n_times(), "Ctrl+Shift+Return")
        menu.addSeparator()
        command(menu, "Export metrics CSV…", w.export_csv, QKeySequence.Save)
        command(menu, "Export trace JSONL…", w.export_jsonl, "Ctrl+Shift+S")
        command(menu, "Export plots PNG/SVG…", w.export_plots, "Ctrl+E")
        self.save_text_action = menu.addAction("Save text…", w.save_text)
        self.save_text_action.setToolTip("Save the clean text of the run shown (no drafts, no marks) as .txt")
        menu.addSeparator()
        self.clear_action = menu.addAction("Clear", w.clear_session)

    def _view_menu(self, menu, view_actions: list) -> None:
        w = self.window
        for action in view_actions:
            menu.addAction(action)
        theme_menu = menu.addMenu("Theme")
        group = QActionGroup(w)
        self.theme_actions = {}
        for theme, label in THEMES:
            action = theme_menu.addAction(label)
            action.setCheckable(True)
            action.triggered.connect(lambda _=False, t=theme: w.apply_theme(t))
            group.addAction(action)
            self.theme_actions[theme] = action
        menu.addSeparator()
        menu.addAction("Reset settings to defaults", w.reset_settings)

    # ============================================================================================= refresh
    def refresh(self, method: str, k: int, greedy: bool, availability: Optional[dict]) -> None:
        """Check the chosen method spec, K and greedy. `availability` (method name -> None or why not)
        disables what the loaded pair cannot run; None (no decoder yet) leaves every method enabled."""
        for spec, action in self.method_actions.items():
            reason = None if availability is None else availability.get(parse_spec(spec).name, UNOFFERED)
            action.setEnabled(reason is None)
            action.setToolTip(f"Unavailable: {reason}" if reason else spec_text(spec))
            action.setChecked(spec == method)
        for value, action in self.k_actions.items():
            action.setChecked(value == k)
        self.greedy_action.setChecked(greedy)

    def set_busy(self, running: bool, loading: bool) -> None:
        """While the decoder runs a job or models load, nothing may start another one or swap the models."""
        for action in self.model_actions + [self.sweep_action, self.method_sweep_action, self.check_action,
                                            self.repeat_action, self.recalibrate_action, self.batch_action]:
            action.setEnabled(not running and not loading)
        self.clear_action.setEnabled(not running)
        self.open_trace_action.setEnabled(not running)  # a replay needs no model

    def show_synthetic(self, description: str) -> None:
        """The K menu names the sweeps' synthetic profile while one is set."""
        self.synthetic_action.setText(f"{SYNTHETIC_TEXT} ({description})" if description else SYNTHETIC_TEXT)

    def check_theme(self, theme: str) -> None:
        for name, action in self.theme_actions.items():
            action.setChecked(name == theme)
