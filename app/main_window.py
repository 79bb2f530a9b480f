"""The main window: prompt, live round view, plots, history, menus, status bar.

All decoding happens in the engine; the window starts workers (app.workers) and consumes the RoundEvents they
emit. Every user-facing error goes through `show_error`, which tests replace.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Optional

from PySide6.QtCore import QByteArray, Qt, QTimer, Signal
from PySide6.QtGui import QActionGroup, QFontDatabase, QGuiApplication, QKeySequence, QPalette
from PySide6.QtWidgets import (QApplication, QDockWidget, QFileDialog, QHBoxLayout, QLabel, QListWidget,
                               QListWidgetItem, QMainWindow, QMessageBox, QPlainTextEdit, QProgressBar,
                               QPushButton, QScrollArea, QSpinBox, QSplitter, QTextBrowser, QVBoxLayout,
                               QWidget)

from app import backend, gc_guard
from app.dialogs import HelpDialog, LosslessDialog, SamplingDialog, SweepDialog
from app.plot_data import PlotBuffers
from app.plots import REDRAW_HZ, PlotPanel
from app.round_view import RoundView, describe, legend_html
from app.tree_view import DraftTreeView
from app.session import METHOD_LABELS, Generation, Session, engine_method, sampling_label, tree_label
from app.settings import APPLICATION, DEFAULTS, ORGANIZATION, AppSettings
from app.style import colors_for, dark_palette, system_is_dark
from app.workers import GenerationWorker, Job, LoadWorker, LosslessWorker, SweepWorker
from engine.config import SamplingParams
from engine.errors import SpecplayError

K_CHOICES = range(1, 17)
SWEEP_KS = (1, 2, 3, 4, 6, 8)  # what "Find the fastest K" measures
CHECK_SAMPLES = 1000  # seeds of "Check lossless"'s chi-squared test (the CLI's check-lossless uses 2000)
CHECK_TEMPERATURE = 0.8  # the sampled check's temperature while the Sampling menu is on greedy


def no_model_text(reason: str = "") -> str:
    """What the window says when it has no model, and how to open one."""
    return "No model is loaded.\n\n" + (f"{reason}\n\n" if reason else "") + HOW_TO_OPEN


HOW_TO_OPEN = (
    "Open a Hugging Face model folder with Models → Open target folder… "
    "(and Models → Open draft folder… for a draft model sharing its tokenizer), "
    "or start with  python main.py --target DIR --draft DIR."
)


class PromptEdit(QPlainTextEdit):
    """The prompt editor: Ctrl+Enter generates, Esc stops."""

    submitted = Signal()
    stopRequested = Signal()

    def keyPressEvent(self, event) -> None:
        enter = event.key() in (Qt.Key_Return, Qt.Key_Enter)
        if enter and event.modifiers() & Qt.ControlModifier:
            self.submitted.emit()
        elif event.key() == Qt.Key_Escape:
            self.stopRequested.emit()
        else:
            super().keyPressEvent(event)


class SteadyLabel(QLabel):
    """A status-bar label whose width only grows: live text that changes every tick would otherwise
    relayout (and repaint) the status bar each time."""

    def __init__(self):
        super().__init__()
        self._widest = 0

    def sizeHint(self):
        hint = super().sizeHint()
        self._widest = max(self._widest, hint.width())
        hint.setWidth(self._widest)
        return hint

    def minimumSizeHint(self):
        return self.sizeHint()


class MainWindow(QMainWindow):
    def __init__(self, loader=backend.load_decoder, device: str = "auto",
                 settings: Optional[AppSettings] = None):
        super().__init__()
        self.setWindowTitle("specplay: speculative decoding playground")
        self.loader = loader
        self.device = device
        self.settings = settings or AppSettings()
        self.session = Session()
        self.decoder = None
        self.calibration = None
        self.availability: dict = {}
        self.target_path: Optional[str] = None
        self.draft_path: Optional[str] = None
        self.models = "none"
        self.gen_job: Optional[Job] = None
        self.sweep_job: Optional[Job] = None  # a measured K sweep (uses the decoder like a generation)
        self.sweep_rows: list = []
        self.sweep_dialog = None
        self.check_job: Optional[Job] = None  # "Check lossless" (uses the decoder like a generation)
        self.check_reports: dict = {}
        self.check_dialog = None
        self.check_samples = CHECK_SAMPLES
        self.load_job: Optional[Job] = None
        self.current: Optional[Generation] = None  # the running generation
        self.shown: Optional[Generation] = None  # the generation in the view and plots
        self._pending: tuple = (None, None, True)  # the (target, draft, quiet) being loaded
        self._pending_error: Optional[tuple] = None  # (title, message) shown once a worker is done
        self._forced_palette = False  # True while the theme overrides a platform that ignores the scheme
        self._unrendered: list = []  # rounds received but not drawn yet
        self.ui_timer = QTimer(self)
        self.ui_timer.setInterval(int(1000 / (2 * REDRAW_HZ)))
        self.ui_timer.timeout.connect(self._ui_tick)
        self.ui_timer.start()
        self._ticks = 0
        self._build_central()
        self._build_docks()
        self._build_menus()
        self._build_status()
        self.resize(1400, 900)
        self.resizeDocks([self.history_dock, self.inspector_dock], [250, 300], Qt.Horizontal)
        self.resizeDocks([self.plots_dock], [360], Qt.Vertical)
        self.resizeDocks([self.inspector_dock, self.tree_dock], [260, 240], Qt.Vertical)
        self._default_state = self.saveState()
        self._restore_layout()
        self.apply_theme(self.settings.get("view/theme"), save=False)
        self._refresh_all()
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._system_scheme_changed)

    # ============================================================================================ building
    def _build_central(self) -> None:
        self.prompt = PromptEdit()
        self.prompt.setPlaceholderText("Type a prompt, then Ctrl+Enter to generate (Esc stops)")
        self.prompt.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
        self.prompt.submitted.connect(self.generate)
        self.prompt.stopRequested.connect(self.stop)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 8192)
        self.max_tokens.setValue(self.settings.get("decode/max_new_tokens"))
        self.max_tokens.setPrefix("max new tokens: ")
        self.max_tokens.valueChanged.connect(lambda v: self.settings.set("decode/max_new_tokens", v))
        self.generate_button = QPushButton("Generate  (Ctrl+Enter)")
        self.generate_button.clicked.connect(self.generate)
        self.stop_button = QPushButton("Stop  (Esc)")
        self.stop_button.clicked.connect(self.stop)
        self.legend = QLabel()
        self.view = RoundView()
        self.view.tokenClicked.connect(self._show_token)
        self.splitter = QSplitter(Qt.Vertical)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.addWidget(self._prompt_area())
        self.splitter.addWidget(self._output_area())
        self.splitter.setSizes([110, 420])
        self.setCentralWidget(self.splitter)

    def _prompt_area(self) -> QWidget:
        side = QVBoxLayout()
        for widget in (self.max_tokens, self.generate_button, self.stop_button):
            side.addWidget(widget)
        side.addStretch(1)
        row = QHBoxLayout()
        row.addWidget(self.prompt, 1)
        row.addLayout(side)
        box = QWidget()
        box.setLayout(row)
        return box

    def _output_area(self) -> QWidget:
        column = QVBoxLayout()
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.legend)
        column.addWidget(self.view, 1)
        box = QWidget()
        box.setLayout(column)
        return box

    def _build_docks(self) -> None:
        self.history = QListWidget()
        self.history.currentRowChanged.connect(self._history_selected)
        self.inspector = QTextBrowser()
        self.inspector.setPlaceholderText("Hover a token for details; click to pin them here.")
        self.plots = PlotPanel()
        self.history_dock = self._dock("History", "historyDock", self.history, Qt.LeftDockWidgetArea)
        self.inspector_dock = self._dock("Token", "inspectorDock", self.inspector, Qt.RightDockWidgetArea)
        self.plots_dock = self._dock("Plots", "plotsDock", self.plots, Qt.BottomDockWidgetArea)
        self.plots_action = self.plots_dock.toggleViewAction()
        self.plots_action.setText("Plots")
        self.tree_view = DraftTreeView()
        self.tree_view.tokenClicked.connect(self._show_token)
        tree_scroll = QScrollArea()
        tree_scroll.setWidget(self.tree_view)
        self.tree_dock = self._dock("Draft tree", "treeDock", tree_scroll, Qt.RightDockWidgetArea)
        self.tree_action = self.tree_dock.toggleViewAction()
        self.tree_action.setText("Draft tree")

    def _dock(self, title: str, name: str, widget: QWidget, area) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(name)
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        return dock

    def _build_menus(self) -> None:
        self._build_method_menu()
        self._build_k_menu()
        self._build_sampling_menu()
        self._build_models_menu()
        self._build_session_menu()
        self._build_view_menu()
        help_menu = self.menuBar().addMenu("&Help")
        help_menu.addAction("The analytic model…", self.show_help)

    def _build_method_menu(self) -> None:
        menu = self.menuBar().addMenu("&Method")
        menu.setToolTipsVisible(True)
        self.method_group = QActionGroup(self)
        self.method_actions = {}
        for method, label in METHOD_LABELS.items():
            action = menu.addAction(label)
            action.setCheckable(True)
            action.setData(method)
            action.triggered.connect(lambda _=False, m=method: self.set_method(m))
            self.method_group.addAction(action)
            self.method_actions[method] = action
        menu.addSeparator()
        self.check_action = menu.addAction("Check lossless…", self.check_lossless)
        self.check_action.setShortcut("Ctrl+L")
        self.check_action.setToolTip("Prove on the prompt that the method did not change the output; Esc stops")

    def _build_k_menu(self) -> None:
        menu = self.menuBar().addMenu("&K")
        group = QActionGroup(self)
        self.k_actions = {}
        for k in K_CHOICES:
            action = menu.addAction(f"K = {k}")
            action.setCheckable(True)
            action.triggered.connect(lambda _=False, value=k: self.set_k(value))
            group.addAction(action)
            self.k_actions[k] = action
        menu.addSeparator()
        self.sweep_action = menu.addAction("Find the fastest K…", self.find_fastest_k)
        self.sweep_action.setToolTip("Measure K = " + ", ".join(map(str, SWEEP_KS)) + " on the prompt; Esc stops")

    def _build_sampling_menu(self) -> None:
        menu = self.menuBar().addMenu("&Sampling")
        self.greedy_action = menu.addAction("Greedy")
        self.greedy_action.setCheckable(True)
        self.greedy_action.triggered.connect(self.set_greedy)
        menu.addAction("Temperature, top-k, top-p, seed…", self.edit_sampling)

    def _build_models_menu(self) -> None:
        menu = self.menuBar().addMenu("M&odels")
        self.model_actions = [
            menu.addAction("Open target folder…", self.open_target_folder),
            menu.addAction("Open draft folder…", self.open_draft_folder),
            menu.addAction("Back to the shipped pair", self.use_shipped_pair),
        ]

    def _build_session_menu(self) -> None:
        menu = self.menuBar().addMenu("S&ession")
        export_csv = menu.addAction("Export metrics CSV…", self.export_csv)
        export_csv.setShortcut(QKeySequence.Save)
        menu.addAction("Export trace JSONL…", self.export_jsonl)
        menu.addAction("Export plots PNG/SVG…", self.export_plots)
        menu.addSeparator()
        self.clear_action = menu.addAction("Clear", self.clear_session)

    def _build_view_menu(self) -> None:
        menu = self.menuBar().addMenu("&View")
        menu.addAction(self.plots_action)
        menu.addAction(self.tree_action)
        menu.addAction(self.history_dock.toggleViewAction())
        menu.addAction(self.inspector_dock.toggleViewAction())
        theme_menu = menu.addMenu("Theme")
        group = QActionGroup(self)
        self.theme_actions = {}
        for theme, label in (("system", "Follow the system"), ("light", "Light"), ("dark", "Dark")):
            action = theme_menu.addAction(label)
            action.setCheckable(True)
            action.triggered.connect(lambda _=False, t=theme: self.apply_theme(t))
            group.addAction(action)
            self.theme_actions[theme] = action
        menu.addSeparator()
        menu.addAction("Reset settings to defaults", self.reset_settings)

    def _build_status(self) -> None:
        names = ("device", "models", "method", "live", "calibration")
        self.status_labels = {name: SteadyLabel() for name in names}
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # busy indicator
        self.progress.setMaximumWidth(120)
        self.progress.setVisible(False)
        self.statusBar().addWidget(self.progress)
        for label in self.status_labels.values():
            self.statusBar().addPermanentWidget(label)

    def _restore_layout(self) -> None:
        geometry, state = self.settings.layout()
        if isinstance(geometry, QByteArray) and not geometry.isEmpty():
            self.restoreGeometry(geometry)
        if isinstance(state, QByteArray) and not state.isEmpty():
            self.restoreState(state)
        self.plots_dock.setVisible(self.settings.get("view/plots"))

    # ============================================================================================= dialogs
    def show_error(self, title: str, message: str) -> None:
        """Every user-facing error comes through here (tests replace it)."""
        QMessageBox.warning(self, title, message)

    def ask_directory(self, title: str) -> Optional[str]:
        return QFileDialog.getExistingDirectory(self, title) or None

    def ask_save_path(self, title: str, file_filter: str) -> Optional[str]:
        path, _ = QFileDialog.getSaveFileName(self, title, "", file_filter)
        return path or None

    def show_help(self) -> None:
        HelpDialog(self).exec()

    # ============================================================================================== models
    def start(self, target: Optional[str] = None, draft: Optional[str] = None) -> None:
        """First load: the given pair, else the saved one, else the shipped pair (quietly: no dialog)."""
        if target or draft:
            self.load_models(target, draft)
        else:
            self.load_models(self.settings.optional_path("models/target"),
                             self.settings.optional_path("models/draft"), quiet=True)

    def load_models(self, target: Optional[str], draft: Optional[str], quiet: bool = False) -> bool:
        if self.load_job is not None or self.running:
            self.show_error("Busy", "Wait for the current generation or model load to finish.")
            return False
        self._pending = (target, draft, quiet)
        worker = LoadWorker(self.loader, target, draft, self.device, self.settings.get("decode/k"))
        self.load_job = Job(worker, loaded=self._models_loaded, failed=self._models_failed, done=self._load_done)
        self.progress.setVisible(True)
        self.statusBar().showMessage(f"Loading {backend.models_label(target, draft)}…")
        self.load_job.start()
        self._refresh_controls()
        return True

    def _models_loaded(self, decoder, calibration) -> None:
        target, draft, _ = self._pending
        self.decoder, self.calibration = decoder, calibration
        self.availability = dict(decoder.method_availability())
        self.target_path, self.draft_path = target, draft
        self.models = backend.models_label(target, draft)
        self.settings.set("models/target", target or "")
        self.settings.set("models/draft", draft or "")
        self._fall_back_if_unavailable()
        if self.shown is None:
            self.view.show_message(f"Loaded {self.models} on {decoder.device_name}. Type a prompt and press "
                                   "Ctrl+Enter.")
        self.statusBar().showMessage(f"Loaded {self.models}", 5000)

    def _models_failed(self, message: str) -> None:
        quiet = self._pending[2]
        if self.decoder is None and self.shown is None:
            self.view.show_message(no_model_text(message))
        if not quiet:
            self._pending_error = ("Could not load the models", message)
        self.statusBar().showMessage("Model loading failed", 5000)

    def _load_done(self) -> None:
        if self.load_job is None:
            return
        self.load_job.finish()
        self.load_job = None
        gc_guard.collect_and_freeze()  # the models and the window are long-lived: later collections skip them
        self.progress.setVisible(False)
        self._refresh_all()
        self._flush_pending_error()

    def _fall_back_if_unavailable(self) -> None:
        method = self.settings.get("decode/method")
        if self.availability.get(engine_method(method), "unknown") is not None:
            fallback = "draft" if self.availability.get("draft", "x") is None else "none"
            self.settings.set("decode/method", fallback)

    def open_target_folder(self) -> None:
        path = self.ask_directory("Open target model folder")
        if path:
            self.load_models(path, self.draft_path)

    def open_draft_folder(self) -> None:
        path = self.ask_directory("Open draft model folder")
        if path:
            self.load_models(self.target_path, path)

    def use_shipped_pair(self) -> None:
        self.load_models(None, None)

    # ============================================================================================ settings
    def set_method(self, method: str) -> None:
        self.settings.set("decode/method", method)
        self._refresh_all()

    def set_k(self, k: int) -> None:
        self.settings.set("decode/k", int(k))
        self._refresh_all()

    def set_greedy(self, greedy: bool) -> None:
        self.settings.set("decode/greedy", bool(greedy))
        self._refresh_all()

    def edit_sampling(self) -> None:
        s = self.settings
        dialog = SamplingDialog(self, s.get("decode/greedy"), s.get("decode/temperature"),
                                s.get("decode/top_k"), s.get("decode/top_p"), s.get("decode/seed"))
        if dialog.exec():
            self.apply_sampling(dialog.values())

    def apply_sampling(self, values: dict) -> None:
        for key, value in values.items():
            self.settings.set(key, value)
        self._refresh_all()

    def apply_theme(self, theme: str, save: bool = True) -> None:
        if save:
            self.settings.set("view/theme", theme)
        app = QApplication.instance()
        schemes = {"light": Qt.ColorScheme.Light, "dark": Qt.ColorScheme.Dark,
                   "system": Qt.ColorScheme.Unknown}
        if self._forced_palette:
            app.setPalette(QPalette())  # back to the platform's palette
            self._forced_palette = False
        if save or theme != "system":
            app.styleHints().setColorScheme(schemes[theme])
        dark = system_is_dark() if theme == "system" else theme == "dark"
        if dark != (app.palette().color(QPalette.Window).lightness() < 128):
            app.setPalette(dark_palette() if dark else app.style().standardPalette())
            self._forced_palette = True
        self._set_colors(colors_for(dark))
        for name, action in self.theme_actions.items():
            action.setChecked(name == theme)

    def _system_scheme_changed(self, _scheme) -> None:
        if self.settings.get("view/theme") == "system":
            self.apply_theme("system", save=False)

    def _set_colors(self, colors) -> None:
        self.view.set_colors(colors)
        self.plots.set_colors(colors)
        self.tree_view.set_colors(colors)
        self.legend.setText(legend_html(colors))
        if self.shown is not None:
            self._render(self.shown)

    def reset_settings(self) -> None:
        shipped = self.target_path is None and self.draft_path is None
        self.settings.reset()
        self.restoreState(self._default_state)
        self.plots_dock.setVisible(True)
        self.max_tokens.setValue(DEFAULTS["decode/max_new_tokens"])
        self.apply_theme("system")
        self._refresh_all()
        if not shipped and not self.running:
            self.load_models(None, None)

    # ========================================================================================== generation
    def generate(self) -> None:
        if self.running:
            return
        prompt = self.prompt.toPlainText()
        problem = self._generation_problem(prompt)
        if problem:
            self.show_error(*problem)
            return
        config = self.settings.config()
        try:
            config.sampling.validate()
        except SpecplayError as exc:
            self.show_error("Bad sampling settings", str(exc))
            return
        self._start_generation(prompt, config)

    def _generation_problem(self, prompt: str) -> Optional[tuple]:
        if not prompt.strip():
            return "Empty prompt", "Type a prompt first, then press Ctrl+Enter."
        if self.load_job is not None:
            return "Models are loading", "Wait for the models to finish loading."
        if self.decoder is None:
            return "No model loaded", no_model_text()
        return None

    def _start_generation(self, prompt: str, config) -> None:
        self.current = self.session.new(prompt, config, self.models, self.calibration)
        self._pending_error = None
        item = QListWidgetItem(self.current.summary())
        self.history.addItem(item)
        self.history.setCurrentRow(self.history.count() - 1)  # shows it
        self.gen_job = Job(GenerationWorker(self.decoder, prompt, config),
                           event=self._on_event, failed=self._on_failed, done=self._on_done)
        self.gen_job.start()
        self._refresh_controls()

    def stop(self) -> None:
        for job in self._decoder_jobs:
            if job is not None:
                job.stop()
                self.statusBar().showMessage("Stopping…", 2000)

    @property
    def running(self) -> bool:
        """A generation, a K sweep or a lossless check is using the decoder."""
        return any(job is not None for job in self._decoder_jobs)

    @property
    def _decoder_jobs(self) -> tuple:
        return self.gen_job, self.sweep_job, self.check_job

    # ============================================================================================= K sweep
    def _drafting_task_inputs(self, why_a_method: str) -> Optional[tuple]:
        """(prompt, config) for a task that runs the drafting method on the prompt (a K sweep, a lossless check),
        or None after a dialog has said what is missing."""
        if self.running:
            return None
        prompt = self.prompt.toPlainText()
        problem = self._generation_problem(prompt)
        config = self.settings.config()
        if problem is None and config.method == "none":
            problem = ("No drafting method", f"Pick a method in the Method menu first: {why_a_method}")
        if problem:
            self.show_error(*problem)
            return None
        return prompt, config

    def _start_task(self, job: Job, status: str) -> None:
        """Start a K sweep or lossless check that is already the window's sweep_job or check_job."""
        job.start()
        self.progress.setVisible(True)
        self.statusBar().showMessage(status)
        self._refresh_controls()

    def _end_task(self, job: Job) -> None:
        """A K sweep or lossless check has posted its last message: join it and give the controls back."""
        job.finish()
        self.progress.setVisible(self.load_job is not None)
        self.statusBar().clearMessage()
        self._refresh_controls()
        self._flush_pending_error()

    def find_fastest_k(self) -> None:
        """Measure each K of SWEEP_KS on the prompt with the current method and sampling, off the GUI thread;
        then show the table and offer the fastest K."""
        inputs = self._drafting_task_inputs("K is the number of tokens it drafts per round.")
        if inputs is None:
            return
        self.sweep_rows = []
        job = Job(SweepWorker(self.decoder, *inputs, SWEEP_KS),
                  row=self._on_sweep_row, failed=self._on_sweep_failed, done=self._on_sweep_done)
        self.sweep_job = job
        self._start_task(job, f"Measuring K = {SWEEP_KS[0]}…")

    def _on_sweep_row(self, row: dict) -> None:
        self.sweep_rows.append(row)
        measured = ", ".join(f"K={r['k']}: {r['speedup']:.2f}×" for r in self.sweep_rows)
        self.statusBar().showMessage(f"Measured {measured}")

    def _on_sweep_failed(self, message: str) -> None:
        self._pending_error = ("K sweep failed", message)

    def _on_sweep_done(self) -> None:
        if self.sweep_job is None:  # closeEvent already joined the thread
            return
        job, self.sweep_job = self.sweep_job, None
        self._end_task(job)
        if self.sweep_rows:
            config = job.worker.config  # as measured, whatever the menus say now
            title = (f"{METHOD_LABELS.get(config.method, config.method)}, "
                     f"{sampling_label(config.sampling, config.seed)}, {config.max_new_tokens} new tokens")
            self.sweep_dialog = SweepDialog(self, self.sweep_rows, title)
            self.sweep_dialog.accepted.connect(lambda: self.set_k(self.sweep_dialog.best))
            self.sweep_dialog.show()

    # ======================================================================================= lossless check
    def check_lossless(self) -> None:
        """On the prompt, off the GUI thread: the method's greedy output against plain greedy decoding, token for
        token, then a chi-squared test of its sampled first two tokens against the target's exact distribution."""
        inputs = self._drafting_task_inputs("the check compares its output with plain decoding.")
        if inputs is None:
            return
        prompt, config = inputs
        sampled = config if not config.sampling.greedy else replace(
            config, sampling=SamplingParams(temperature=CHECK_TEMPERATURE))
        self.check_reports = {}
        job = Job(LosslessWorker(self.decoder, prompt, config, sampled, self.check_samples),
                  greedy=self._on_check_report("greedy"), sampling=self._on_check_report("sampling"),
                  failed=self._on_check_failed, done=self._on_check_done)
        self.check_job = job
        self._start_task(job, "Checking greedy output against plain decoding…")

    def _on_check_report(self, kind: str):
        def store(report) -> None:
            self.check_reports[kind] = report
            if kind == "greedy":
                self.statusBar().showMessage(f"Greedy check done; sampling {self.check_samples} seeds…")
        return store

    def _on_check_failed(self, message: str) -> None:
        self._pending_error = ("Lossless check failed", message)

    def _on_check_done(self) -> None:
        if self.check_job is None:  # closeEvent already joined the thread
            return
        job, self.check_job = self.check_job, None
        self._end_task(job)
        if "greedy" in self.check_reports:
            config = job.worker.config  # as checked, whatever the menus say now
            title = (f"{METHOD_LABELS.get(config.method, config.method)}, K={config.k}, "
                     f"{config.max_new_tokens} new tokens")
            self.check_dialog = LosslessDialog(self, title, self.check_reports["greedy"],
                                               self.check_reports.get("sampling"), job.worker.sampled_config.sampling,
                                               self._describe_token)
            self.check_dialog.show()

    def _describe_token(self, token: int) -> str:
        return f"{token} {self.decoder.tokenizer.decode([token])!r}" if self.decoder is not None else str(token)

    def _on_event(self, event) -> None:
        """Record the round at once; draw it on the next UI tick (see _flush_rounds)."""
        gen = self.current
        if gen is None:
            return
        gen.add(event)
        self._unrendered.append(event)

    def _ui_tick(self) -> None:
        """Take the workers' messages, then draw. Ticks alternate between the text view and one plot, so one
        event-loop pass never paints both: together they made the longest gaps (~35 ms on a 2-core machine,
        scripts/stall_probe.py)."""
        self._deliver_messages()
        gc_guard.collect_young()
        self._ticks += 1
        if self._ticks % 2:
            self._flush_rounds()
        else:
            self.plots.redraw_if_dirty()

    def _deliver_messages(self) -> None:
        for job in (self.load_job,) + self._decoder_jobs:
            if job is not None:
                job.deliver()

    def _flush_rounds(self) -> None:
        """Every other UI tick (20 Hz): draw the rounds that arrived since the last time, so the text view,
        history and status bar repaint at most 20 times a second however fast rounds come."""
        events, self._unrendered = self._unrendered, []
        gen = self.current or (self.session.generations[-1] if self.session.generations else None)
        if not events or gen is None:
            return
        if self.shown is gen:
            self.view.append_events(events)
            self.tree_view.set_event(events[-1])  # the latest round, live
        self._update_history_item(gen)
        self._refresh_live(events[-1])

    def _on_failed(self, message: str) -> None:
        if self.current is not None:
            self.current.error = message
        self._pending_error = ("Generation failed", message)

    def _on_done(self) -> None:
        if self.gen_job is None:  # closeEvent already joined the thread
            return
        stopped = self.gen_job.worker.stop_requested
        self.gen_job.finish()
        self.gen_job = None
        self._flush_rounds()
        gen, self.current = self.current, None
        gen.finish = self._finish_reason(gen, stopped)
        if self.shown is gen:
            self.view.append_finish(gen.finish)
        self._update_history_item(gen)
        self._refresh_controls()
        self._flush_pending_error()

    @staticmethod
    def _finish_reason(gen: Generation, stopped: bool) -> str:
        if gen.error:
            return "error"
        last = gen.events[-1].finish_reason if gen.events else None
        return last or ("stopped" if stopped else "ended")

    def _flush_pending_error(self) -> None:
        error, self._pending_error = self._pending_error, None
        if error:
            self.show_error(*error)

    # ============================================================================================= history
    def _history_selected(self, row: int) -> None:
        if 0 <= row < len(self.session.generations):
            self._render(self.session.generations[row])

    def _render(self, gen: Generation) -> None:
        self.shown = gen
        if gen is self.current:
            self._unrendered = []  # show_generation draws every round received so far
        self.view.show_generation(gen.prompt, gen.events, gen.finish)
        self.plots.set_buffers(gen.buffers)
        self.tree_view.set_event(gen.events[-1] if gen.events else None)

    def _update_history_item(self, gen: Generation) -> None:
        item = self.history.item(gen.index - 1)
        if item is not None:
            item.setText(gen.summary())

    def clear_session(self) -> None:
        if self.running:
            self.show_error("Generation running", "Stop the generation before clearing the session.")
            return
        self.session.clear()
        self.shown = None
        self.history.clear()
        self.view.clear_view()
        self.plots.set_buffers(PlotBuffers())
        self.inspector.clear()
        self.tree_view.set_event(None)

    def _show_token(self, info) -> None:
        """Pin a token's details, and draw the draft tree of its round."""
        self.inspector.setHtml(describe(info))
        events = self.shown.events if self.shown is not None else []
        if 0 <= info.round < len(events) and self.tree_view.event is not events[info.round]:
            self.tree_view.set_event(events[info.round])

    # ============================================================================================== export
    def export_csv(self) -> None:
        self._export("Export metrics CSV", "CSV (*.csv)", ".csv", "write_csv")

    def export_jsonl(self) -> None:
        self._export("Export trace JSONL", "JSON Lines (*.jsonl)", ".jsonl", "write_jsonl")

    def _export(self, title: str, file_filter: str, suffix: str, writer_name: str) -> None:
        events = self.session.all_events()
        if not events:
            self.show_error(title, "Nothing to export yet: generate something first.")
            return
        path = self.ask_save_path(title, file_filter)
        if not path:
            return
        from engine import metrics

        try:
            rows = getattr(metrics, writer_name)(events, path)
        except SpecplayError as exc:
            self.show_error(title, str(exc))
            return
        self.statusBar().showMessage(f"Wrote {rows} rounds to {path}", 5000)

    def export_plots(self) -> None:
        if self.shown is None:
            self.show_error("Export plots", "Nothing to plot yet: generate something first.")
            return
        path = self.ask_save_path("Export plots", "PNG image (*.png);;SVG drawing (*.svg)")
        if not path:
            return
        if not path.lower().endswith((".png", ".svg")):
            path += ".png"
        try:
            with open(path, "ab"):
                pass
            self.plots.export(path)
        except OSError as exc:
            self.show_error("Export plots", f"cannot write {path}: {exc.strerror or exc}")
            return
        self.statusBar().showMessage(f"Wrote plots to {path}", 5000)

    # ============================================================================================== status
    def _refresh_all(self) -> None:
        self._refresh_menus()
        self._refresh_controls()
        self._refresh_status()

    def _refresh_menus(self) -> None:
        s = self.settings
        method = s.get("decode/method")
        for name, action in self.method_actions.items():
            reason = self.availability.get(engine_method(name), "not offered by the engine") if self.decoder else None
            action.setEnabled(reason is None)
            action.setToolTip(f"Unavailable: {reason}" if reason else METHOD_LABELS[name])
            action.setChecked(name == method)
        for k, action in self.k_actions.items():
            action.setChecked(k == s.get("decode/k"))
        self.greedy_action.setChecked(s.get("decode/greedy"))

    def _refresh_controls(self) -> None:
        busy = self.load_job is not None
        self.generate_button.setEnabled(not self.running and not busy)
        self.stop_button.setEnabled(self.running)
        for action in self.model_actions:
            action.setEnabled(not self.running and not busy)
        self.sweep_action.setEnabled(not self.running and not busy)
        self.check_action.setEnabled(not self.running and not busy)
        self.clear_action.setEnabled(not self.running)

    def _refresh_status(self) -> None:
        s, labels = self.settings, self.status_labels
        labels["device"].setText(f"Device: {self.decoder.device_name}" if self.decoder else "Device: —")
        labels["models"].setText(f"Models: {self.models}")
        config = s.config()
        k = "" if config.method == "none" else f", K={config.k}{tree_label(config)}"
        labels["method"].setText(f"{METHOD_LABELS.get(config.method, config.method)}{k}, "
                                 f"{sampling_label(config.sampling, config.seed)}")
        cal = self.calibration
        labels["calibration"].setText(f"TPOT_plain {cal.target_step_ms:.2f} ms · c {cal.c:.2f}" if cal else
                                      "TPOT_plain — · c —")
        if not labels["live"].text():
            labels["live"].setText("α — · — tok/s")

    def _refresh_live(self, event) -> None:
        m = event.metrics
        alpha = f"α {m.acceptance_rate:.2f}" if m.drafted else "α —"
        self.status_labels["live"].setText(f"{alpha} · {m.tokens_per_s:.0f} tok/s")

    # ============================================================================================= closing
    def closeEvent(self, event) -> None:
        self.settings.save_layout(self.saveGeometry(), self.saveState())
        self.settings.set("view/plots", not self.plots_dock.isHidden())
        self.settings.sync()
        self.current = None
        for job in self._decoder_jobs + (self.load_job,):
            if job is not None:
                job.stop()
                job.finish()
        self.gen_job = self.sweep_job = self.check_job = self.load_job = None
        self.ui_timer.stop()
        super().closeEvent(event)


# The decoding thread shares the GIL with this one. Qt calls release the GIL, and taking it back waits up to the
# switch interval while the decoder runs Python. With the default 5 ms, a plot repaint next to a busy Python
# thread took a median 34 ms instead of 2.4 ms; 0.5 ms brings it to 7.6 ms (scripts/plot_paint_bench.py).
GIL_SWITCH_INTERVAL_S = 0.0005


def run_gui(target: Optional[str] = None, draft: Optional[str] = None, device: str = "auto") -> int:
    """Open the window (main.py's default command). Returns the application's exit code."""
    app = QApplication.instance() or QApplication(sys.argv)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    try:
        backend.preload_engine()
    except Exception:  # noqa: BLE001 - the window opens anyway; loading will report the engine's error
        pass
    window = MainWindow(device=device)
    window.show()
    window.start(target, draft)
    return app.exec()
