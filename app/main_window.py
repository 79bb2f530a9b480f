"""The main window: prompt, live round view, plots, history, menus, status bar; the wiring between them.

All decoding happens in the engine. The window runs each kind of background job (model loading, generation,
K sweep, lossless check) in its own slot (app.jobs), which hands the workers' messages to the window's
handlers on the UI tick. The menu bar is built by app.menus, the exports live in app.exports. Every
user-facing error goes through `show_error`, which tests replace.
"""
from __future__ import annotations

import html
import os
import queue
import sys
from dataclasses import replace
from typing import Optional

from PySide6.QtCore import QByteArray, Qt, QTimer
from PySide6.QtGui import QAction, QFontDatabase, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QCheckBox,
    QDialog,
    QDockWidget,
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app import autosave, backend, batch_dialog, exports, figures, gc_guard, style
from app.banner import Banner
from app.compare import CompareTable, plain_reference
from app.diagnosis_view import CalibrateWorker, DiagnosisView, DiagnosisWorker
from app.dialogs import HelpDialog, LosslessDialog, MethodSweepDialog, SamplingDialog, SweepDialog
from app.heads import DoctorDialog, DoctorWorker, HeadsSourceDialog, HeadsWorker, doctor_method
from app.jobs import JobSlot
from app.menus import Menus, spec_text
from app.plot_data import PlotBuffers
from app.plots import NUMBERING, REDRAW_HZ, PlotPanel
from app.round_view import RoundView, clean_text, describe, legend_html, round_tokens
from app.server_dialog import ConnectWorker, ServerDialog, served_note, served_refusal
from app.session import Generation, Session, method_label, sampling_label
from app.settings import APPLICATION, DEFAULTS, EXPORT_FOLDER_KEY, METHOD_KEY, ORGANIZATION, AppSettings
from app.tree_view import TreePanel
from app.widgets import PromptEdit, SteadyLabel, ask_path, settle_clipboard
from app.workers import (
    BatchWorker,
    GenerationWorker,
    Job,
    LoadWorker,
    LosslessWorker,
    MethodSweepWorker,
    SweepWorker,
)
from engine.config import SamplingParams
from engine.core.synthetic import SyntheticAcceptance, synthetic_note
from engine.errors import SpecplayError
from engine.methods.registry import parse_spec, runnable_menu_specs

SWEEP_KS = (1, 2, 3, 4, 6, 8)  # what "Find the fastest K" measures
CHECK_SAMPLES = 1000  # seeds of "Check lossless"'s chi-squared test (the CLI's check-lossless uses 2000)
CHECK_TEMPERATURE = 0.8  # the sampled check's temperature while the Sampling menu is on greedy
COMPACT_SIZE = (1100, 700)  # below this width or height the plots collapse to tabs
# the default layout's shares of the window: History, the right column, the plots, the inspector in its column
DOCK_SHARES = {"history": 0.16, "right": 0.27, "plots": 0.48, "inspector": 0.3}
REFIT = 0.1  # the docks are set back to their shares when the window changes size by this fraction
MAX_NEW_TOKENS = 8192  # the spin box's limit before a model is loaded (then: the model's context)
LAST_SESSION = "the last session"  # where a restored generation came from (its History entry says replayed)
SESSION_NOTICE_MS = 8000
SYNTHETIC_PROMPT = ("synthetic acceptance (L, or rates p1,p2,…) for the K and method sweeps and the batch "
                    "regime; empty: the models' own acceptance")


def _sweep_title(config, first: str, rows: list, tail: str = "", ks: tuple = ()) -> str:
    """A sweep dialog's title (what was measured: settings, new tokens, a synthetic profile's note); rows
    measured with a profile are labelled so (their saved CSV too)."""
    label_synthetic(rows, config)
    return (f"{first}, {sampling_label(config.sampling, config.seed)}, {config.max_new_tokens} new tokens"
            f"{tail}{synthetic_title(config, ks)}")


def synthetic_title(config, ks: tuple = ()) -> str:
    """A sweep dialog's title line saying its results follow a synthetic profile ("" for real ones)."""
    note = synthetic_note(config)
    if not note:
        return ""
    left = [k for k in SWEEP_KS if ks and k not in ks]
    skipped = f" (K = {', '.join(map(str, left))} left out: the profile does not fit them)" if left else ""
    return f"<br><b>{html.escape(note)}</b>{skipped}"


def label_synthetic(rows: list, config) -> None:
    """Rows measured with a synthetic profile carry it (their saved CSV says so)."""
    if config.synthetic_acceptance:
        for row in rows:
            row["synthetic_acceptance"] = config.synthetic_acceptance


def no_model_text(reason: str = "") -> str:
    """What the window says when it has no model, and how to open one."""
    return "No model is loaded.\n\n" + (f"{reason}\n\n" if reason else "") + HOW_TO_OPEN


HOW_TO_OPEN = (
    "Open a Hugging Face model folder with Models → Open target folder… "
    "(and Models → Open draft folder… for a draft model sharing its tokenizer), "
    "or start with  python main.py --target DIR --draft DIR."
)


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
        self.served = None  # a ServedDecoder while generations come from a server (Connect to a server…)
        self.calibration = None
        self._wanted_method: Optional[str] = None  # the method a load switched away from (it comes back)
        self.availability: dict = {}
        self.target_path: Optional[str] = None
        self.draft_path: Optional[str] = None
        self.models = "none"
        self.forward_path = ""  # which forward runs each loaded model, and why off the fast path
        self.load_slot = JobSlot("model loading")
        self.gen_slot = JobSlot("generation")
        # "Find the fastest K" and "Find the fastest method" (they use the decoder like a generation)
        self.sweep_slot = JobSlot("sweep")
        self.check_slot = JobSlot("lossless check")  # "Check lossless" (uses the decoder like a generation)
        self.calibrate_slot = JobSlot("calibration")  # K → Recalibrate costs (times the decoder's models)
        self.batch_slot = JobSlot("batch regime")  # K → Batch regime (batches the decoder's models)
        self.diagnosis_slot = JobSlot("diagnosis")  # Why is it slow? for the generation shown (no decoder)
        self.doctor_slot = JobSlot("head doctor")  # Models → Head doctor… (runs the decoder's heads)
        self.synthetic_acceptance = ""  # the sweeps' synthetic profile ("" = real verdicts); not kept
        self.heads_source = ""  # the last heads folder or id opened (Models → Open draft heads…)
        self.doctor_dialog = None
        self._diagnosing: Optional[Generation] = None  # the generation whose diagnosis is being made
        self._diagnosis_wanted: Optional[Generation] = None  # the next one, asked while that runs
        self.sweep_rows: list = []
        self.sweep_dialog = None
        self.method_sweep_rows: list = []
        self.method_sweep_complete = True  # False: the sweep was stopped (its rows are what it measured)
        self.method_dialog = None
        self.batch_rows: list = []
        self.batch_dialog = None
        self.batch_sizes: Optional[tuple] = None  # what K → Batch regime measures; None: by the device
        self.batch_new_tokens = batch_dialog.BATCH_NEW_TOKENS
        self.check_reports: dict = {}
        self.check_dialog = None
        self.check_samples = CHECK_SAMPLES
        self.current: Optional[Generation] = None  # the running generation
        self.shown: Optional[Generation] = None  # the generation in the view and plots
        self._pending: tuple = (None, None, True)  # the (target, draft, quiet) being loaded
        self._pending_error: Optional[tuple] = None  # (title, message) shown once a worker is done
        self._forced_palette = False  # True while the theme overrides a platform that ignores the scheme
        self._unrendered: list = []  # rounds received but not drawn yet
        self.repeats_left = 0  # "Run N times": generations still to start after the running one
        self.context_limit: Optional[int] = None  # tokens the loaded pair can hold (prompt + generated)
        self.ui_timer = QTimer(self)
        self.ui_timer.setInterval(int(1000 / (2 * REDRAW_HZ)))
        self.ui_timer.timeout.connect(self._ui_tick)
        self.ui_timer.start()
        self._ticks = 0
        self._build_central()
        self._build_docks()
        self._build_menus()
        self._build_status()
        self._build_shortcuts()
        self.resize(1400, 900)
        self._fit_docks(1400, 900)
        self._default_state = self.saveState()
        self._docks_fitted_for = None  # fitted again to the size the window is shown at
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
        self.max_tokens.setRange(1, MAX_NEW_TOKENS)
        self.max_tokens.setValue(self.settings.get("decode/max_new_tokens"))
        self.max_tokens.setPrefix("max new tokens: ")
        self.max_tokens.valueChanged.connect(lambda v: self.settings.set("decode/max_new_tokens", v))
        self.generate_button = QPushButton("Generate  (Ctrl+Enter)")
        self.generate_button.clicked.connect(self.generate)
        self.stop_button = QPushButton("Stop  (Esc)")
        self.stop_button.clicked.connect(self.stop)
        self.legend = QLabel()
        self.legend.setWordWrap(True)
        self.clean_toggle = QCheckBox("Clean text  (Ctrl+T)")
        self.clean_toggle.setToolTip("Show what the model produced, without the drafts and round marks")
        self.clean_toggle.toggled.connect(self.set_clean_text)
        self.view = RoundView()
        self.view.tokenClicked.connect(self._show_token)
        self.splitter = QSplitter(Qt.Vertical)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.addWidget(self._prompt_area())
        self.splitter.addWidget(self._output_area())
        self.splitter.setSizes([90, 440])  # the prompt takes a few lines: the text gets the room
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
        self.banner = Banner()  # what the app changed on its own (a dropped draft, a switched method)
        column.addWidget(self.banner)
        top = QHBoxLayout()
        top.addWidget(self.legend, 1)
        top.addWidget(self.clean_toggle)
        column.addLayout(top)
        column.addWidget(self.view, 1)
        box = QWidget()
        box.setLayout(column)
        return box

    def _build_docks(self) -> None:
        self.history = QListWidget()
        self.history.setSelectionMode(QAbstractItemView.ExtendedSelection)
        self.history.setToolTip("Select several runs (Ctrl/Shift+click) to compare them. " + NUMBERING)
        self.history.currentRowChanged.connect(self._history_selected)
        self.history.itemSelectionChanged.connect(self._selection_changed)
        self.compare = CompareTable()
        self.inspector = QTextBrowser()
        self.inspector.setPlaceholderText("Hover a token for details; click to pin them here.")
        self.plots = PlotPanel()
        self.history_dock = self._dock("History", "historyDock", self.history, Qt.LeftDockWidgetArea)
        self.inspector_dock = self._dock("Token", "inspectorDock", self.inspector, Qt.RightDockWidgetArea)
        self.plots_dock = self._dock("Plots", "plotsDock", self.plots, Qt.BottomDockWidgetArea)
        self.tree_panel = TreePanel()
        self.tree_view = self.tree_panel.view
        self.tree_view.tokenClicked.connect(self._show_token)
        self.tree_dock = self._dock("Draft tree", "treeDock", self.tree_panel, Qt.BottomDockWidgetArea)
        self.compare_dock = self._dock("Compare", "compareDock", self.compare, Qt.RightDockWidgetArea)
        self.diagnosis = DiagnosisView()
        self.diagnosis_dock = self._dock("Why is it slow?", "diagnosisDock", self.diagnosis,
                                         Qt.RightDockWidgetArea)
        self._arrange_docks()
        self.plots_action = self._raising_action(self.plots_dock)
        self.tree_action = self._raising_action(self.tree_dock)
        self.compare_action = self._raising_action(self.compare_dock)

    def _arrange_docks(self) -> None:
        """The default layout: the text in the middle, the History on its left, a column on its right (the
        token inspector over Why is it slow? and Compare as tabs), and the plots below all three, across the
        window. The draft tree is a tab beside the plots: opened, it gets the width of the window."""
        self.setCorner(Qt.BottomLeftCorner, Qt.BottomDockWidgetArea)
        self.setCorner(Qt.BottomRightCorner, Qt.BottomDockWidgetArea)
        self.splitDockWidget(self.inspector_dock, self.diagnosis_dock, Qt.Vertical)
        self.tabifyDockWidget(self.diagnosis_dock, self.compare_dock)
        self.tabifyDockWidget(self.plots_dock, self.tree_dock)
        self.diagnosis_dock.raise_()
        self.plots_dock.raise_()

    def _raising_action(self, dock: QDockWidget) -> QAction:
        """A View menu entry that brings a dock into sight: one that is open but hidden behind a tab is
        raised (a toggle would close it on the first click); one in sight is closed."""
        action = QAction(dock.windowTitle(), self)
        action.setCheckable(True)
        action.setChecked(dock.isVisible())
        dock.visibilityChanged.connect(lambda _: action.setChecked(not dock.isHidden()))

        def bring() -> None:
            in_sight = dock.isVisible() and not dock.visibleRegion().isEmpty()
            if in_sight:
                dock.hide()
            else:
                dock.show()
                dock.raise_()
            action.setChecked(not dock.isHidden())

        action.triggered.connect(bring)
        return action

    def _dock(self, title: str, name: str, widget: QWidget, area) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(name)
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        return dock

    def _build_menus(self) -> None:
        view_actions = [self.plots_action, self.tree_action, self.compare_action,
                        self.history_dock.toggleViewAction(), self.inspector_dock.toggleViewAction(),
                        self._raising_action(self.diagnosis_dock)]
        m = self.menus = Menus(self, view_actions, SWEEP_KS)
        self.method_actions, self.k_actions = m.method_actions, m.k_actions  # keyed by spec string and by K
        self.theme_actions, self.greedy_action = m.theme_actions, m.greedy_action
        self.check_action, self.sweep_action = m.check_action, m.sweep_action
        self.method_sweep_action = m.method_sweep_action
        self.batch_action = m.batch_action
        self.heads_action, self.doctor_action, self.synthetic_action = (m.heads_action, m.doctor_action,
                                                                        m.synthetic_action)

    def _build_status(self) -> None:
        names = ("device", "models", "method", "live", "calibration")
        self.status_labels = {name: SteadyLabel() for name in names}
        self.progress = QProgressBar()  # permanent: status messages never hide it
        self.progress.setRange(0, 0)  # busy until a job reports counts
        self.progress.setMinimumWidth(220)
        self.progress.setMaximumWidth(320)
        self.progress.setVisible(False)
        self.statusBar().addPermanentWidget(self.progress)
        for label in self.status_labels.values():
            self.statusBar().addPermanentWidget(label)

    def _build_shortcuts(self) -> None:
        """Window-wide keys: they work wherever the focus is (the output view, the history, a dock)."""
        keys = [("Esc", self.stop), ("Ctrl+Return", self.generate), ("Ctrl+Enter", self.generate),
                ("Ctrl+T", lambda: self.clean_toggle.toggle()), ("Ctrl+]", lambda: self.step_k(1)),
                ("Ctrl+[", lambda: self.step_k(-1))]
        self.shortcuts = {}
        for key, slot in keys:
            shortcut = QShortcut(QKeySequence(key), self)
            shortcut.setContext(Qt.WindowShortcut)
            shortcut.activated.connect(slot)
            self.shortcuts[key] = shortcut

    def set_progress(self, done: Optional[int], total: Optional[int], text: str = "") -> None:
        """The status bar's progress: counts when known (`done` of `total`), else a busy bar."""
        if total:
            self.progress.setRange(0, int(total))
            self.progress.setValue(int(done or 0))
        else:
            self.progress.setRange(0, 0)
        full = (text or "%v of %m").replace("%v", str(int(done or 0))).replace("%m", str(int(total or 0)))
        # one line that fits the bar (a long step would wrap and be clipped); the tooltip has all of it
        width = self.progress.maximumWidth() - 16
        fitted = self.progress.fontMetrics().elidedText(full, Qt.ElideRight, width)
        self.progress.setFormat(fitted)
        self.progress.setTextVisible(True)
        self.progress.setToolTip(full)

    def _restore_layout(self) -> None:
        geometry, state = self.settings.layout()
        if isinstance(geometry, QByteArray) and not geometry.isEmpty():
            self.restoreGeometry(geometry)
        if isinstance(state, QByteArray) and not state.isEmpty() and self.restoreState(state):
            self._docks_fitted_for = (self.width(), self.height())  # the user's dock sizes stay
        self.plots_dock.setVisible(self.settings.get("view/plots"))

    # ============================================================================================= dialogs
    def show_error(self, title: str, message: str) -> None:
        """Every user-facing error comes through here (tests replace it)."""
        QMessageBox.warning(self, title, message)

    def ask_directory(self, title: str) -> Optional[str]:
        return ask_path(self, title, QFileDialog.Directory)

    def ask_save_path(self, title: str, file_filter: str, name: str = "") -> Optional[str]:
        """A save dialog proposing the file `name` in the folder of the last export (kept in the settings)."""
        folder = self.settings.get(EXPORT_FOLDER_KEY)
        path = ask_path(self, title, QFileDialog.AnyFile, file_filter, save=True,
                        folder=folder if os.path.isdir(folder) else os.path.expanduser("~"), name=name)
        if path:
            self.settings.set(EXPORT_FOLDER_KEY, os.path.dirname(os.path.abspath(path)))
        return path

    def ask_open_path(self, title: str, file_filter: str) -> Optional[str]:
        return ask_path(self, title, QFileDialog.ExistingFile, file_filter)

    def show_help(self) -> None:
        """Help (F1): a window of its own that stays open beside the main one."""
        if getattr(self, "help_dialog", None) is None:
            self.help_dialog = HelpDialog(self)
        self.help_dialog.show()
        self.help_dialog.raise_()

    def show_status(self, message: str, timeout_ms: int = 0) -> None:
        self.statusBar().showMessage(message, timeout_ms)

    # ================================================================================================ jobs
    @property
    def running(self) -> bool:
        """A generation, a K sweep or a lossless check is using the decoder."""
        return any(slot.busy for slot in self._decoder_slots)

    @property
    def _decoder_slots(self) -> tuple:
        return (self.gen_slot, self.sweep_slot, self.check_slot, self.calibrate_slot, self.batch_slot,
                self.doctor_slot)

    @property
    def load_job(self) -> Optional[Job]:
        """The model load in progress, or None (tests and scripts wait for None)."""
        return self.load_slot.job

    @property
    def gen_job(self) -> Optional[Job]:
        return self.gen_slot.job

    def _start_job(self, slot: JobSlot, worker, status: Optional[str] = None, **handlers) -> None:
        """Start a job in its slot. Loads, sweeps and checks show `status` in the progress bar (counts come
        with their "progress" messages); a generation shows its progress in the view and the bar."""
        handlers.setdefault("progress", self.set_progress)
        slot.start(worker, **handlers)
        if status:
            self.show_status(status)
        self.set_progress(None, None, status or "")
        self._sync_progress()
        self._refresh_controls()

    def _job_ended(self) -> None:
        """A job has been joined (its slot is idle): give the controls back, then show the error it left."""
        self._sync_progress()
        self._refresh_controls()
        self._flush_pending_error()

    def _sync_progress(self) -> None:
        self.progress.setVisible(self.load_slot.busy or self.running or self.calibrate_slot.busy)

    def _fail_later(self, title: str):
        """A "failed" handler: keep the message for a dialog once the job has been joined."""
        def keep(message: str) -> None:
            self._pending_error = (title, message)
        return keep

    def _flush_pending_error(self) -> None:
        error, self._pending_error = self._pending_error, None
        if error:
            self.show_error(*error)

    def _ui_tick(self) -> None:
        """Take the workers' messages, then draw. Ticks alternate between the text view and one plot, so one
        event-loop pass never paints both: together they made the longest gaps (~35 ms on a 2-core machine,
        scripts/stall_probe.py, at tag before-house-cleanup)."""
        for slot in (self.load_slot, self.diagnosis_slot) + self._decoder_slots:
            slot.deliver()
        gc_guard.collect_young()
        self._ticks += 1
        if self._ticks % 2:
            self._flush_rounds()
        else:
            self.plots.redraw_if_dirty()

    def stop(self) -> None:
        """Esc, anywhere in the window: stop whatever uses the decoder (and the runs still queued)."""
        self.repeats_left = 0
        for slot in self._decoder_slots:
            if slot.stop():
                self.show_status("Stopping…", 2000)

    # ============================================================================================== models
    def start(self, target: Optional[str] = None, draft: Optional[str] = None) -> None:
        """First load: the given pair, else the saved one, else the shipped pair (quietly: no dialog)."""
        if self.settings.notice:  # a corrupt settings file was reset (app/settings.py)
            self.show_error("Settings reset", self.settings.notice)
        self.restore_session()
        if target or draft:
            self.load_models(target, draft)
        else:
            self.load_models(self.settings.optional_path("models/target"),
                             self.settings.optional_path("models/draft"), quiet=True)

    def load_models(self, target: Optional[str], draft: Optional[str], quiet: bool = False,
                    draft_optional: bool = False) -> bool:
        """Load a pair off the GUI thread. draft_optional: a draft kept from the last pair, loaded with the
        new target where it fits it, dropped (with a banner) where it does not."""
        if self.load_slot.busy or self.running:
            self.show_error("Busy", "Wait for the current generation or model load to finish.")
            return False
        self._pending = (target, draft, quiet)
        worker = LoadWorker(self.loader, target, draft, self.device, self.settings.get("decode/k"),
                            draft_optional)
        self._start_job(self.load_slot, worker, f"Loading {backend.models_label(target, draft)}…",
                        loaded=self._models_loaded, failed=self._models_failed, done=self._load_done,
                        draft_dropped=self._draft_dropped)
        self.set_progress(0, 2, "Loading the models (1 of 2)…")
        return True

    def _models_loaded(self, decoder, calibration) -> None:
        target, draft, _ = self._pending
        self.decoder, self.calibration = decoder, calibration
        self.availability = dict(decoder.method_availability())
        self._limit_max_tokens(backend.context_limit(decoder))
        self.target_path, self.draft_path = target, draft
        # suffix decoding goes on from the session's suffix generations on this target (kept ones too)
        backend.remember_generations(decoder, self.session.suffix_generations(target or "shipped"))
        self.models = backend.models_label(target, draft)
        self.forward_path = backend.forward_path_text(decoder)
        self.settings.set("models/target", target or "")
        self.settings.set("models/draft", draft or "")
        self._fall_back_if_unavailable()
        if self.shown is None:
            self.view.show_message(f"Loaded {self.models} on {decoder.device_name}. Type a prompt and press "
                                   "Ctrl+Enter. F1 opens Help: what every view and number means.")
        self.show_status(f"Loaded {self.models} ({self.forward_path})", 8000)
        if backend.off_fast_path(self.forward_path):  # no trees, CUDA graphs or fused step for that model
            self.banner.notify(f"Not every model runs on the fast path: {self.forward_path}.")

    def _draft_dropped(self, draft: str, why: str) -> None:
        target, _, quiet = self._pending
        self._pending = (target, None, quiet)
        self.banner.notify(f"The draft model {draft} does not fit the target {target}, so the target loaded "
                           f"alone: {why}")

    def _models_failed(self, message: str) -> None:
        quiet = self._pending[2]
        if self.decoder is None and self.shown is None:
            self.view.show_message(no_model_text(message))
        if not quiet:
            self._pending_error = ("Could not load the models", message)
        self.show_status("Model loading failed", 5000)

    def _load_done(self, _job: Job) -> None:
        gc_guard.collect_and_freeze()  # the models and the window are long-lived: later collections skip them
        self._refresh_menus()
        self._refresh_status()
        self._job_ended()

    def _fall_back_if_unavailable(self) -> None:
        """A method the new models cannot run gives way to one they can, with a banner; the method the user
        chose comes back, with a banner too, once a later pair runs it."""
        wanted = self._wanted_method
        if wanted and self.availability.get(parse_spec(wanted).name) is None:
            self._wanted_method = None
            if wanted != self.settings.get(METHOD_KEY):
                self.settings.set(METHOD_KEY, wanted)
                self.banner.notify(f"Method back to {spec_text(wanted)}: these models run it.")
            return
        spec = self.settings.get(METHOD_KEY)
        why = self.availability.get(parse_spec(spec).name, "unknown to these models")
        if why is not None:
            fallback = "draft" if self.availability.get("draft", "x") is None else "none"
            self.settings.set(METHOD_KEY, fallback)
            self._wanted_method = self._wanted_method or spec
            self.banner.notify(f"Method switched from {spec_text(spec)} to {spec_text(fallback)}: {why}. "
                               "It comes back when models that run it are loaded.")

    def open_target_folder(self) -> None:
        """A new target keeps the draft in use (the shipped draft too) where it fits it."""
        path = self.ask_directory("Open target model folder")
        if path:
            draft = self.draft_path or (backend.shipped_draft() if self.target_path is None else None)
            self.load_models(path, draft, draft_optional=True)

    def open_draft_folder(self) -> None:
        path = self.ask_directory("Open draft model folder")
        if path:
            self.load_models(self.target_path, path)

    def use_shipped_pair(self) -> None:
        self.served = None
        self.load_models(None, None)

    def connect_to_server(self) -> None:
        """Models → Connect to a server…: the next generations come from it (connecting runs off the GUI
        thread; a server that cannot be reached is one dialog)."""
        if self.running or self.load_slot.busy:
            return
        dialog = ServerDialog(self)
        if dialog.exec() != ServerDialog.Accepted:
            return
        self._start_job(self.load_slot, ConnectWorker(*dialog.choice()), status="Connecting to the server…",
                        connected=self._on_connected, failed=self._on_connect_failed,
                        done=self._on_loaded_job)

    def _on_connected(self, served) -> None:
        self.served = served
        self.show_status(served_note(served))

    def _on_connect_failed(self, message: str) -> None:
        self._pending_error = ("Cannot use the server", message)

    def _on_loaded_job(self, job) -> None:
        self._job_ended()

    def show_info(self, title: str, message: str) -> None:
        """An information dialog (tests replace it)."""
        QMessageBox.information(self, title, message)

    def _served_refusal(self, what: str) -> bool:
        """True (after a dialog) while generations come from a server: `what` would run the local models."""
        if self.served is None:
            return False
        self.show_error("Connected to a server", served_refusal(what, self.served.device_name))
        return True

    def _needs_local_models(self, what: str) -> bool:
        """True (after a dialog) when `what` cannot run now: connected to a server, busy or no models."""
        if self._served_refusal(what):
            return True
        if self.running or self.load_slot.busy:
            self.show_error("Busy", "Wait for the current job or model load to finish.")
            return True
        if self.decoder is None:
            self.show_error("No model loaded", no_model_text())
            return True
        return False

    def open_draft_heads(self, source: Optional[str] = None) -> None:
        """Models → Open draft heads…: published heads (a folder or a cached Hub id) loaded onto the loaded
        target off the GUI thread; their description in a dialog, their methods in the Method menu."""
        if self._needs_local_models("Opening draft heads"):
            return
        if source is None:
            dialog = HeadsSourceDialog(self, self.heads_source)
            if dialog.exec() != QDialog.Accepted:
                return
            source = dialog.choice()
        if not source:
            self.show_error("No heads given", "Give a heads folder or an id already in the HF cache.")
            return
        self.heads_source = source
        self._start_job(self.load_slot, HeadsWorker(self.decoder, source), f"Loading draft heads {source}…",
                        heads=self._on_heads, failed=self._fail_later("Cannot use these heads"),
                        done=self._load_done)

    def _on_heads(self, description: str, availability: dict) -> None:
        self.availability = availability
        offered = [spec_text(s) for s in runnable_menu_specs(availability)[0]
                   if parse_spec(s).name in ("eagle", "eagle3", "medusa", "medusa-fixed")]
        self.show_info("Draft heads loaded", f"{description}\n\nfits the loaded target: yes\nthe Method "
                       f"menu offers: {', '.join(offered) or 'none of their methods on this target'}")

    def head_doctor(self) -> None:
        """Models → Head doctor…: the heads' acceptance by draft position under each convention their config
        leaves open (engine.analysis.doctor), off the GUI thread; the report in a dialog."""
        if self._needs_local_models("The head doctor"):
            return
        method = doctor_method(parse_spec(self.settings.get(METHOD_KEY)).name, self.decoder.heads_info)
        if method is None:
            self.show_error("No heads to diagnose", "Pick EAGLE, EAGLE-3 or Medusa in the Method menu, or "
                            "open published heads with Models → Open draft heads…, first.")
            return
        why = self.availability.get(method, "unknown to these models")
        if why is not None:
            self.show_error("No heads to diagnose", f"{spec_text(method)} cannot run here: {why}")
            return
        prompt = self.prompt.toPlainText()
        worker = DoctorWorker(self.decoder, method, self.settings.get("decode/k"),
                              [prompt] if prompt.strip() else None)
        self._start_job(self.doctor_slot, worker, f"Head doctor: measuring {spec_text(method)} under each "
                        f"convention on {worker.prompts_text}, {worker.max_new_tokens} tokens each…",
                        report=self._on_doctor_report, failed=self._fail_later("Head doctor failed"),
                        done=lambda job: self._task_ended())

    def _on_doctor_report(self, report) -> None:
        self.doctor_dialog = DoctorDialog(self, report)
        self.doctor_dialog.show()

    # ============================================================================================ settings
    def set_method(self, spec: str) -> None:
        """Pick a method spec of the Method menu ('draft', 'eagle:8')."""
        self.settings.set(METHOD_KEY, spec)
        self._wanted_method = None  # the user's own choice: nothing to bring back
        self._refresh_all()

    def set_k(self, k: int) -> None:
        self.settings.set("decode/k", int(k))
        self._refresh_all()

    def step_k(self, step: int) -> None:
        """Ctrl+] and Ctrl+[: the next larger or smaller K of the K menu."""
        ks = sorted(self.k_actions)
        k = self.settings.get("decode/k")
        self.set_k(min(ks[-1], max(ks[0], k + step)))

    def set_clean_text(self, clean: bool) -> None:
        """Round view (drafts, rejections, round marks) or the clean text the model produced."""
        if self.clean_toggle.isChecked() != bool(clean):
            self.clean_toggle.setChecked(bool(clean))  # comes back here through `toggled`
            return
        self.view.set_clean(clean)
        self.legend.setVisible(not clean)
        if self.shown is not None:
            self._render(self.shown)

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
        dark, self._forced_palette = style.apply_theme(theme, save or theme != "system", self._forced_palette)
        self._set_colors(style.colors_for(dark))
        self.menus.check_theme(theme)

    def _system_scheme_changed(self, _scheme) -> None:
        if self.settings.get("view/theme") == "system":
            self.apply_theme("system", save=False)

    def _set_colors(self, colors) -> None:
        self.view.set_colors(colors)
        self.plots.set_colors(colors)
        self.tree_panel.set_colors(colors)
        self.legend.setText(legend_html(colors))
        if self.shown is not None:
            self._render(self.shown)

    def reset_settings(self) -> None:
        shipped = self.target_path is None and self.draft_path is None
        self.settings.reset()
        self.restoreState(self._default_state)
        self.plots_dock.setVisible(True)
        self._docks_fitted_for = None
        self._fit_docks(self.width(), self.height())
        self.max_tokens.setValue(DEFAULTS["decode/max_new_tokens"])
        self.apply_theme("system")
        self._refresh_all()
        if not shipped and not self.running:
            self.load_models(None, None)

    # ========================================================================================== generation
    def generate(self) -> None:
        inputs = self._run_inputs()
        if inputs is not None:
            self._start_generation(*inputs)

    def _run_inputs(self) -> Optional[tuple]:
        """(prompt, config) for a run of the menus' settings on the prompt, or None after a dialog has said
        what is wrong (no prompt or model, bad sampling settings, too long for the context)."""
        if self.running:
            return None
        prompt = self.prompt.toPlainText()
        problem = self._generation_problem(prompt)
        if problem:
            self.show_error(*problem)
            return None
        config = self.settings.config()
        try:
            config.sampling.validate()
        except SpecplayError as exc:
            self.show_error("Bad sampling settings", str(exc))
            return None
        problem = self._length_problem(prompt, config)
        if problem:
            self.show_error("Too long for the model", problem)
            return None
        return prompt, config

    def _limit_max_tokens(self, limit: Optional[int]) -> None:
        """max-new-tokens can never exceed what the loaded pair's context holds."""
        self.context_limit = limit
        top = MAX_NEW_TOKENS if limit is None else max(1, min(MAX_NEW_TOKENS, limit - 2))
        self.max_tokens.setMaximum(top)
        self.max_tokens.setToolTip(f"at most {top}: the loaded models' context is {limit} tokens"
                                   if limit else "")

    def _length_problem(self, prompt: str, config) -> Optional[str]:
        """Why prompt + max-new-tokens + K does not fit the context (checked before a run starts)."""
        if self.context_limit is None or self.served is not None:  # a server checks its own context
            return None
        prompt_tokens = backend.count_tokens(self.decoder, prompt)
        needed = prompt_tokens + config.max_new_tokens + config.drafts + 2
        if needed <= self.context_limit:
            return None
        room = max(0, self.context_limit - prompt_tokens - config.drafts - 2)
        return (f"The prompt ({prompt_tokens} tokens) + max new tokens ({config.max_new_tokens}) + K does "
                f"not fit the models' context of {self.context_limit} tokens: at most {room} new tokens fit.")

    def _generation_problem(self, prompt: str) -> Optional[tuple]:
        if not prompt.strip():
            return "Empty prompt", "Type a prompt first, then press Ctrl+Enter."
        if self.load_slot.busy:
            return "Models are loading", "Wait for the models to finish loading."
        if self.decoder is None and self.served is None:
            return "No model loaded", no_model_text()
        return None

    def _start_generation(self, prompt: str, config) -> None:
        origin = {"target": self.target_path or "shipped", "draft": self.draft_path or
                  ("shipped" if self.target_path is None else None),
                  "device": getattr(self.decoder, "device_name", None),
                  "dtype": backend.dtype_name(self.decoder),
                  "prompt_ids": backend.prompt_ids(self.decoder, prompt)}
        if self.served is not None:  # a served engine: its label, no local models
            origin = {"target": self.served.device_name, "draft": None, "device": self.served.device_name,
                      "dtype": None, "prompt_ids": None}
        self.current = self.session.new(prompt, config, self.models, self.calibration, origin)
        self._pending_error = None
        self.history.addItem(QListWidgetItem(self.current.summary()))
        self.history.clearSelection()
        self.history.setCurrentRow(self.history.count() - 1)  # shows it
        self._start_job(self.gen_slot, GenerationWorker(self.served or self.decoder, prompt, config),
                        event=self._on_event, failed=self._on_failed, done=self._on_done)

    def _on_event(self, event) -> None:
        """Record the round at once; draw it on the next UI tick (see _flush_rounds)."""
        gen = self.current
        if gen is None:
            return
        gen.add(event)
        self._unrendered.append(event)

    def _flush_rounds(self) -> None:
        """Every other UI tick (20 Hz): draw the rounds that arrived since the last time, so the text view,
        history and status bar repaint at most 20 times a second however fast rounds come."""
        events, self._unrendered = self._unrendered, []
        gen = self.current or (self.session.generations[-1] if self.session.generations else None)
        if not events or gen is None:
            return
        if self.shown is gen:
            self.view.append_events(events)
            self.tree_panel.follow(gen.events)  # the latest round, live
        self._update_history_item(gen)
        self._refresh_live(events[-1])
        self.set_progress(gen.tokens, gen.config.max_new_tokens, "Generating: %v of %m tokens")

    def _on_failed(self, message: str) -> None:
        if self.current is not None:
            self.current.error = message
        self._pending_error = ("Generation failed", message)

    def _on_done(self, job: Job) -> None:
        self._flush_rounds()
        gen, self.current = self.current, None
        gen.finish = self._finish_reason(gen, job.worker.stop_requested)
        if self.shown is gen:
            self.view.append_finish(gen.finish)
        self._update_history_item(gen)
        gen.suffix_replay = backend.suffix_replay(self.decoder, gen.config)
        if gen.events and gen.events[0].served:  # no phase times from a server: nothing to diagnose
            self.show_status(served_note(self.served) if self.served else gen.events[0].served)
        else:
            self._diagnose(gen)
        self._job_ended()
        self._refresh_figures(diagnosed=gen)
        self.keep_session()
        self._next_repeat(gen)

    @staticmethod
    def _finish_reason(gen: Generation, stopped: bool) -> str:
        if gen.error:
            return "error"
        last = gen.events[-1].finish_reason if gen.events else None
        return last or ("stopped" if stopped else "ended")

    # ===================================================================== drafting tasks: K sweep, lossless
    def _drafting_task_inputs(self, why_a_method: str) -> Optional[tuple]:
        """(prompt, config) for a task that runs the drafting method on the prompt (a K sweep, a lossless
        check), or None after a dialog has said what is missing."""
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

    def _task_ended(self) -> None:
        self.statusBar().clearMessage()
        self._job_ended()

    def find_fastest_k(self) -> None:
        """Measure each K of SWEEP_KS on the prompt with the current method and sampling, off the GUI thread;
        then show the table and offer the fastest K."""
        if self._served_refusal("Find the fastest K"):
            return
        inputs = self._drafting_task_inputs("K is the number of tokens it drafts per round.")
        fitting = inputs and self._synthetic_ks(inputs[1])
        if not fitting:
            return
        (prompt, _), (config, ks) = inputs, fitting
        self.sweep_rows = []
        self._start_job(self.sweep_slot, SweepWorker(self.decoder, prompt, config, ks),
                        f"Measuring K = {ks[0]}…", row=self._on_sweep_row, again=self._on_sweep_again,
                        steadiest=self._on_sweep_steadiest, failed=self._fail_later("K sweep failed"),
                        done=self._on_sweep_done)

    def find_fastest_method(self) -> None:
        """Measure every method of the Method menu that the pair can run on the prompt, at the current K and
        sampling, round-robin with plain decoding, off the GUI thread; then show the table and offer the
        fastest."""
        if self._served_refusal("Find the fastest method"):
            return
        inputs = self._run_inputs()
        config = inputs and self._with_synthetic(inputs[1])
        if config is None:
            return
        specs, left_out = runnable_menu_specs(self.decoder.method_availability())
        self.method_sweep_rows = []
        worker = MethodSweepWorker(self.decoder, inputs[0], config, specs)
        self._start_job(self.sweep_slot, worker, "Method sweep: warming up each method…",
                        rows=self._on_method_sweep_rows,
                        failed=self._fail_later("Method sweep failed"),
                        done=lambda job: self._on_method_sweep_done(job, left_out))

    # ================================================================ synthetic acceptance for the sweeps
    def set_synthetic_acceptance(self, text: Optional[str] = None) -> bool:
        """K → Synthetic acceptance for sweeps…: a profile (a mean length L or rates p1,p2,…) that the K and
        method sweeps and the batch regime follow instead of the target's verdicts (a timing study: their
        results say SYNTHETIC); "" measures real acceptance again. A malformed profile is a dialog."""
        if text is None:
            text, ok = QInputDialog.getText(self, "Synthetic acceptance for sweeps", SYNTHETIC_PROMPT,
                                            text=self.synthetic_acceptance)
            if not ok:
                return False
        try:
            profile = SyntheticAcceptance.parse(text)
        except SpecplayError as exc:
            self.show_error("Bad synthetic acceptance", str(exc))
            return False
        self.synthetic_acceptance = "" if profile is None else profile.text
        self.menus.show_synthetic(profile.describe() if profile else "")
        self.show_status(f"Sweeps follow a synthetic {profile.describe()}: their results are not the "
                         "models' acceptance" if profile else "Sweeps measure the models' own acceptance",
                         8000)
        return True

    def _with_synthetic(self, config):
        """config with the sweeps' synthetic profile, or None after a dialog when K cannot follow it."""
        config = replace(config, synthetic_acceptance=self.synthetic_acceptance)
        try:
            config.validate()
        except SpecplayError as exc:
            self.show_error("Bad synthetic acceptance", f"{exc}. Change K or the profile (K → Synthetic "
                            "acceptance for sweeps…).")
            return None
        return config

    def _synthetic_ks(self, config) -> Optional[tuple]:
        """(config with the profile, the Ks of SWEEP_KS it fits) for the K sweep; None after a dialog when it
        fits none (a length L needs K ≥ L − 1, rates need K ≥ their count)."""
        config = replace(config, synthetic_acceptance=self.synthetic_acceptance)
        ks, why = [], ""
        for k in SWEEP_KS:
            try:
                replace(config, k=k).validate()
                ks.append(k)
            except SpecplayError as exc:
                why = str(exc)
        if not ks:
            self.show_error("Bad synthetic acceptance", f"No K of {', '.join(map(str, SWEEP_KS))} can follow "
                            f"the profile: {why}")
            return None
        if len(ks) < len(SWEEP_KS):
            self.show_status(f"K sweep: K = {', '.join(str(k) for k in SWEEP_KS if k not in ks)} left out: "
                             "the synthetic profile does not fit them", 8000)
        return config, tuple(ks)

    def _synthetic_refused(self, config) -> bool:
        """Check lossless runs on real verification: with a synthetic profile it is refused in a dialog (the
        engine's own refusal, engine.analysis.lossless.refuse_synthetic)."""
        from engine.analysis.lossless import refuse_synthetic

        try:
            refuse_synthetic(replace(config, synthetic_acceptance=self.synthetic_acceptance))
        except SpecplayError as exc:
            message = str(exc)
            self.show_error("Check lossless refused", f"{message[:1].upper()}{message[1:]}. Clear it with "
                            "K → Synthetic acceptance for sweeps… (an empty profile).")
            return True
        return False

    def _on_method_sweep_rows(self, rows: list, complete: bool) -> None:
        self.method_sweep_rows.extend(rows)
        self.method_sweep_complete = complete

    def _on_method_sweep_done(self, job: Job, left_out: dict) -> None:
        self._task_ended()
        if self.method_sweep_rows:
            config = job.worker.config  # as measured, whatever the menus say now
            title = _sweep_title(config, f"K = {config.k}", self.method_sweep_rows, ", on the prompt")
            self.method_dialog = MethodSweepDialog(self, self.method_sweep_rows, title, left_out,
                                                   self.method_sweep_complete)
            self.method_dialog.accepted.connect(lambda: self.set_method(self.method_dialog.best))
            self.method_dialog.show()
        elif not self._pending_error:
            self.show_status("The method sweep stopped while warming up: it measured nothing.", 8000)

    def _on_sweep_row(self, row: dict) -> None:
        self.sweep_rows.append(row)
        self.show_status("Measured " + ", ".join(f"K={r['k']}: {r['speedup']:.2f}×" for r in self.sweep_rows))
        done, ks = len(self.sweep_rows), self.sweep_slot.job.worker.ks
        following = f"; measuring K = {ks[done]}" if done < len(ks) else ""
        self.set_progress(done, len(ks), f"K sweep: %v of %m Ks measured{following}")

    def _on_sweep_again(self, sweep: int) -> None:
        """The machine's speed moved during the last sweep: measuring every K again."""
        self.sweep_rows = []
        self.show_status(f"The machine's speed moved during the sweep: sweeping again ({sweep} of "
                         f"{SweepWorker.passes})")

    def _on_sweep_steadiest(self, rows: list) -> None:
        self.sweep_rows = list(rows)

    def _on_sweep_done(self, job: Job) -> None:
        self._task_ended()
        if self.sweep_rows:
            config = job.worker.config  # as measured, whatever the menus say now
            title = _sweep_title(config, method_label(config), self.sweep_rows, ks=job.worker.ks)
            complete = len(self.sweep_rows) == len(job.worker.ks)
            self.sweep_dialog = SweepDialog(self, self.sweep_rows, title, complete=complete)
            self.sweep_dialog.accepted.connect(lambda: self.set_k(self.sweep_dialog.best))
            self.sweep_dialog.show()

    def batch_regime(self) -> None:
        """K → Batch regime: the prompt decoded at each batch size, plainly and speculatively, with the loaded
        models batched (no reload), off the GUI thread; then the gain against the batch beside the roofline's
        prediction and a suggested operating point."""
        if self._served_refusal("The batch regime"):
            return
        inputs = self._drafting_task_inputs("the batch regime compares it with plain decoding.")
        if inputs is None:
            return
        prompt, config = inputs
        problem = batch_dialog.method_problem(config.method, config.tree_nodes)
        if problem:
            self.show_error(*problem)
            return
        config = self._with_synthetic(replace(config, max_new_tokens=min(config.max_new_tokens,
                                                                          self.batch_new_tokens)))
        if config is None:
            return
        device = getattr(getattr(self.decoder, "device", None), "type", "cpu")
        batches = self.batch_sizes or batch_dialog.default_batches(device)
        self.batch_rows = []
        self._start_job(self.batch_slot, BatchWorker(self.decoder, prompt, config, batches,
                                                     batch_dialog.BATCH_KS),
                        f"Batch regime: measuring B = {batches[0]}…", row=self._on_batch_row,
                        report=self._on_batch_report, failed=self._fail_later("Batch regime failed"),
                        done=lambda job: self._task_ended())

    def _on_batch_row(self, row) -> None:
        self.batch_rows.append(row)
        self.show_status("Measured " + ", ".join(f"B={r.batch}: {r.speedup:.2f}×" for r in self.batch_rows))
        batches, done = self.batch_slot.job.worker.batches, len(self.batch_rows)
        following = f"; B = {batches[done]} next" if done < len(batches) else "; fitting"
        self.set_progress(done, len(batches), f"Batch regime: %v of %m{following}")

    def _on_batch_report(self, report) -> None:
        config, batches = self.batch_slot.job.worker.config, self.batch_slot.job.worker.batches
        title = (f"{method_label(config)}, K={config.k}, {sampling_label(config.sampling, config.seed)}, "
                 f"the prompt × B, {config.max_new_tokens} new tokens each, {self.decoder.device_name}"
                 f"{synthetic_title(config)}")
        complete = len(report.rows) == len(batches)
        self.batch_dialog = batch_dialog.BatchDialog(self, report, title, complete, self.plots.colors)
        self.batch_dialog.show()

    def recalibrate(self) -> None:
        """Time the cost model again (verification curve, draft and overhead terms) off the GUI thread."""
        if self._served_refusal("Recalibrate costs"):
            return
        if self.decoder is None or self.running or self.load_slot.busy:
            self.show_error("Busy", "Load models and wait for the current job to finish first.")
            return
        self._start_job(self.calibrate_slot, CalibrateWorker(self.decoder, self.settings.get("decode/k")),
                        "Calibrating the cost model…", calibrated=self._calibrated,
                        failed=self._fail_later("Calibration failed"), done=lambda job: self._task_ended())

    def _calibrated(self, calibration) -> None:
        self.calibration = calibration
        self._refresh_status()
        self.show_status("Recalibrated: " + calibration.costs.describe(self.settings.config().method), 8000)

    def check_lossless(self) -> None:
        """On the prompt, off the GUI thread: the method's greedy output against plain greedy decoding, token
        for token, then a chi-squared test of its sampled first two tokens against the target's exact
        distribution."""
        if self._served_refusal("Check lossless"):
            return
        inputs = self._drafting_task_inputs("the check compares its output with plain decoding.")
        if inputs is None:
            return
        prompt, config = inputs
        if self._synthetic_refused(config):
            return
        sampled = config if not config.sampling.greedy else replace(
            config, sampling=SamplingParams(temperature=CHECK_TEMPERATURE))
        self.check_reports = {}
        worker = LosslessWorker(self.decoder, prompt, config, sampled, self.check_samples)
        self._start_job(self.check_slot, worker, "Lossless check: greedy output against plain decoding…",
                        greedy=self._on_check_report("greedy"), sampling=self._on_check_report("sampling"),
                        failed=self._fail_later("Lossless check failed"), done=self._on_check_done)

    def _on_check_report(self, kind: str):
        def store(report) -> None:
            self.check_reports[kind] = report
            if kind == "greedy":
                self.show_status(f"Greedy check done; sampling {self.check_samples} seeds…")
                self.set_progress(0, self.check_samples, "Lossless check: %v of %m seeds")
        return store

    def _on_check_done(self, job: Job) -> None:
        self._task_ended()
        if "greedy" in self.check_reports:
            config = job.worker.config  # as checked, whatever the menus say now
            title = f"{method_label(config)}, K={config.k}, {config.max_new_tokens} new tokens"
            reports = self.check_reports
            self.check_dialog = LosslessDialog(self, title, reports["greedy"], reports.get("sampling"),
                                               job.worker.sampled_config.sampling, self._describe_token)
            self.check_dialog.show()

    def _describe_token(self, token: int) -> str:
        if self.decoder is None:
            return str(token)
        return f"{token} {self.decoder.tokenizer.decode([token])!r}"

    # ============================================================================================= history
    def _history_selected(self, row: int) -> None:
        if 0 <= row < len(self.session.generations):
            self._render(self.session.generations[row])

    def _selected_generations(self) -> list:
        rows = sorted(self.history.row(item) for item in self.history.selectedItems())
        return [self.session.generations[r] for r in rows if 0 <= r < len(self.session.generations)]

    def _selection_changed(self) -> None:
        """Several runs selected: overlay them on the plots and list them in the Compare table."""
        selected = self._selected_generations()
        self.compare.refresh(self.session.generations, selected, self.calibration)
        if len(selected) > 1:
            self.compare_dock.show()
            self.compare_dock.raise_()
        if self.shown is not None:
            self._render_plots(self.shown)

    def compare_rows(self, rows: list) -> None:
        """Select these History rows (0-based) for comparison, as a Ctrl+click would."""
        self.history.clearSelection()
        for row in rows:
            self.history.item(row).setSelected(True)

    def _render(self, gen: Generation) -> None:
        if gen is not self.shown:
            self.inspector.clear()  # a token pinned in another run is not this run's
        self.shown = gen
        if gen is self.current:
            self._unrendered = []  # show_generation draws every round received so far
        self.view.show_generation(gen.prompt, gen.events, gen.finish)
        self._render_plots(gen)
        self.tree_panel.set_events(gen.events)
        if not gen.running:  # a finished or replayed run: why it was as fast as it was (live: once it ends)
            self._diagnose(gen)

    def _render_plots(self, gen: Generation) -> None:
        """The shown run's plots; the other selected runs overlaid; a plain run's TPOT as reference."""
        others = [g for g in self._selected_generations() if g is not gen]
        self.plots.set_buffers(gen.buffers, [(f"#{g.index} {g.config.spec}", g.buffers) for g in others])
        gen.buffers.set_plain(self.plain_tpot(gen))
        reference = plain_reference(self.session.generations, gen, self.calibration)
        self.plots.set_reference(*reference if reference else (None,))
        self._refresh_status()

    def plain_tpot(self, gen: Optional[Generation]):
        """TPOT_plain for gen (app.figures): its plain runs', else the calibration's; the one value every view
        shows."""
        return figures.plain_tpot(self.session.generations, gen, self.calibration)

    def _refresh_figures(self, diagnosed: Optional[Generation] = None) -> None:
        """A run ended: TPOT_plain may now be measured. Every generation's plots, the Compare table, the
        status bar and the shown run's plots and diagnosis (unless it is `diagnosed`, just asked for) take
        the new value at once."""
        for gen in self.session.generations:
            gen.buffers.set_plain(self.plain_tpot(gen))
        self.compare.refresh(self.session.generations, self._selected_generations(), self.calibration)
        if self.shown is not None:
            self._render_plots(self.shown)
            if not self.shown.running and self.shown is not diagnosed:
                self._diagnose(self.shown)
        self._refresh_status()

    def _diagnose(self, gen: Generation) -> None:
        """Why is it slow? for this generation, off the GUI thread (DiagnosisWorker); asked again while one
        runs, the latest request waits for it and the one running is not shown."""
        if self.diagnosis_slot.busy:
            self._diagnosis_wanted = gen
            return
        self._diagnosing = gen
        worker = DiagnosisWorker(gen.events, gen.calibration, gen.header(), gen.replay(),
                                 self.plain_tpot(gen))
        self.diagnosis_slot.start(worker, diagnosis=self._on_diagnosis, done=self._on_diagnosis_done)

    def _on_diagnosis(self, diagnosis, problem) -> None:
        if self._diagnosing is not None and self._diagnosis_wanted is None:  # not superseded, not cleared
            self.diagnosis.show_diagnosis(diagnosis, problem)

    def _on_diagnosis_done(self, job) -> None:
        wanted, self._diagnosis_wanted = self._diagnosis_wanted, None
        self._diagnosing = None
        if wanted is not None:
            self._diagnose(wanted)

    @property
    def diagnosing(self) -> bool:
        """A diagnosis is being made or waits (tests and scripts wait for False)."""
        return self.diagnosis_slot.busy or self._diagnosis_wanted is not None

    def _update_history_item(self, gen: Generation) -> None:
        item = self.history.item(gen.index - 1)
        if item is not None:
            item.setText(gen.summary())

    def clear_session(self) -> None:
        if self.running:
            self.show_error("Generation running", "Stop the generation before clearing the session.")
            return
        self.session.clear()
        autosave.forget(self.settings.session_path())  # the user asked for a fresh session
        if self.decoder is not None:
            backend.forget_session(self.decoder)
        self.shown = None
        self.history.clear()
        self.view.clear_view()
        self.plots.set_buffers(PlotBuffers())
        self.plots.set_reference(None)
        self.inspector.clear()
        self.tree_panel.set_events([])
        self._diagnosing = self._diagnosis_wanted = None  # a diagnosis on its way is of a forgotten run
        self.diagnosis.clear_generation()
        self.compare.refresh([], [])

    def _show_token(self, info) -> None:
        """Pin a token's details, and draw the draft tree of its round."""
        self.inspector.setHtml(describe(info))
        events = self.shown.events if self.shown is not None else []
        if 0 <= info.round < len(events) and self.tree_view.event is not events[info.round]:
            self.tree_panel.show_round(info.round)

    # ============================================================================================== export
    def export_csv(self) -> None:
        exports.export_rounds(self, self.session.runs(), "csv")

    def export_jsonl(self) -> None:
        exports.export_rounds(self, self.session.runs(), "jsonl")

    def save_text(self) -> None:
        """Session → Save text…: the clean text of the generation shown (what the model produced)."""
        exports.save_text(self, self.shown_clean_text())

    def shown_clean_text(self) -> str:
        if self.shown is None:
            return ""
        return clean_text([info for event in self.shown.events for info in round_tokens(event)])

    def open_trace(self, path: Optional[str] = None) -> bool:
        """Session → Open trace…: replay a saved JSONL trace into the window, each of its generations a
        History entry with every view and plot as if it had run live."""
        if self.running:
            self.show_error("Generation running", "Stop the generation before opening a trace.")
            return False
        path = path or self.ask_open_path(exports.OPEN_TITLE, exports.OPEN_FILTER)
        if not path:
            return False
        runs = exports.read_trace(self, path)
        if not runs:
            return False
        self._add_runs(runs, path)
        self.show_status(f"Replayed {len(runs)} generations from {path}", exports.NOTICE_MS)
        self.keep_session()
        return True

    def _recorded_elsewhere(self, run) -> Optional[str]:
        """Why a read-back run's models are not the loaded ones, or None (the same, or not recorded)."""
        from engine.files.trace import other_models
        from engine.methods import registry as methods

        method = run.config.method
        uses_draft = method in methods.NAMES and methods.get(method).needs_draft_model
        return other_models(run.models, self.target_path, self.draft_path, uses_draft)

    def _add_runs(self, runs: list, source: str) -> None:
        """Saved runs as History entries, each with every view and plot as if it had run live; suffix
        decoding's memory takes those on the loaded target, as the session's own."""
        added, others = [], []
        for run in runs:
            other = self._recorded_elsewhere(run)
            gen = self.session.add_run(run, source, None if other else self.calibration)
            self.history.addItem(QListWidgetItem(gen.summary()))
            added.append(gen)
            if other:
                others.append(f"#{gen.index}: {other}")
        if others:  # the loaded models' costs would price another model's rounds
            self.banner.notify(f"{len(others)} opened generation(s) ran on other models ({others[0]}): their "
                             "predictions use their own phase times, not the loaded models' calibration")
        if self.decoder is not None:
            target = self.target_path or "shipped"
            backend.remember_generations(self.decoder, self.session.suffix_generations(target, added))
        self.history.clearSelection()
        self.history.setCurrentRow(self.history.count() - 1)
        if runs[-1].prompt:
            self.prompt.setPlainText(runs[-1].prompt)

    # ======================================================================================= the kept session
    def restore_session(self) -> int:
        """The generations of the window's last life (app.autosave), back in the History; returns how many."""
        runs, problem = autosave.load(self.settings.session_path())
        if problem:  # the window opens anyway, and says what it set aside
            self.show_status(problem, SESSION_NOTICE_MS)
        if not runs:
            return 0
        self._add_runs(runs, LAST_SESSION)
        for gen in self.session.generations:
            gen.kept = True  # already in the folder
        restored = (f"Restored {len(runs)} generations of the last session (Session → Clear session "
                    f"starts afresh)")
        self.show_status(f"{restored}. {problem}" if problem else restored, SESSION_NOTICE_MS)
        return len(runs)

    def keep_session(self) -> None:
        """Write the generations not kept yet where the next window reads them: after each generation, a
        replay, and on close (the running one, cut short)."""
        fresh = [g for g in self.session.generations if g.events and not g.kept and not g.running]
        if not fresh:
            return
        problem = autosave.keep(self.settings.session_path(), [g.to_run() for g in fresh])
        for gen in fresh:
            gen.kept = problem is None
        if problem:
            self.show_status(problem, SESSION_NOTICE_MS)

    # ============================================================================================= repeats
    def run_n_times(self, n: Optional[int] = None) -> None:
        """Session → Run N times: the same prompt and settings N times in a row, for the spread of tokens/s;
        the runs are selected for comparison as they finish."""
        if n is None:
            from PySide6.QtWidgets import QInputDialog

            n, ok = QInputDialog.getInt(self, "Run N times", "Runs of the current settings:", 5, 2, 50)
            if not ok:
                return
        if self.running:
            return
        first = len(self.session.generations)
        self.generate()
        if self.running:
            self.repeats_left = int(n) - 1
            self._repeat_from = first

    def _next_repeat(self, gen: Generation) -> None:
        if self.repeats_left <= 0 or gen.finish not in ("eos", "length"):
            self.repeats_left = 0
            return
        self.repeats_left -= 1
        self._start_generation(gen.prompt, gen.config)
        self._select_repeats()

    def _select_repeats(self) -> None:
        rows = range(getattr(self, "_repeat_from", 0), self.history.count())
        self.history.blockSignals(True)
        for row in rows:
            self.history.item(row).setSelected(True)
        self.history.blockSignals(False)
        self._selection_changed()

    # ============================================================================================== layout
    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        size = event.size()
        self.plots.set_compact(size.width() < COMPACT_SIZE[0] or size.height() < COMPACT_SIZE[1])
        QTimer.singleShot(0, lambda: self._fit_docks(self.width(), self.height()))  # once laid out

    def _fit_docks(self, width: int, height: int) -> None:
        """Docks grow and shrink with the window: whenever it changes size by REFIT or more, they are set
        back to their share of it (in between, a user's own dock sizes are left alone)."""
        last = getattr(self, "_docks_fitted_for", None)
        if last and abs(width - last[0]) < REFIT * last[0] and abs(height - last[1]) < REFIT * last[1]:
            return
        self._docks_fitted_for = (width, height)
        share = DOCK_SHARES
        self.resizeDocks([self.history_dock, self.inspector_dock],
                         [int(share["history"] * width), int(share["right"] * width)], Qt.Horizontal)
        self.resizeDocks([self.plots_dock], [int(share["plots"] * height)], Qt.Vertical)
        inspector = int(share["inspector"] * height)
        self.resizeDocks([self.inspector_dock, self.diagnosis_dock], [inspector, height - inspector],
                         Qt.Vertical)

    def export_plots(self) -> None:
        exports.export_plots(self, self.plots, self.shown is not None)

    # ============================================================================================== status
    def _refresh_all(self) -> None:
        self._refresh_menus()
        self._refresh_controls()
        self._refresh_status()

    def _refresh_menus(self) -> None:
        s = self.settings
        self.menus.refresh(s.get(METHOD_KEY), s.get("decode/k"), s.get("decode/greedy"),
                           self.availability if self.decoder else None)

    def _refresh_controls(self) -> None:
        loading = self.load_slot.busy
        self.generate_button.setEnabled(not self.running and not loading)
        self.stop_button.setEnabled(self.running)
        self.menus.set_busy(self.running, loading)

    def _refresh_status(self) -> None:
        s, labels = self.settings, self.status_labels
        labels["device"].setText(f"Device: {self.decoder.device_name}" if self.decoder else "Device: —")
        labels["models"].setText(f"Models: {self.models}{backend.path_suffix(self.forward_path)}")
        labels["models"].setToolTip(self.forward_path)
        config = s.config()
        k = "" if config.method == "none" else f", K={config.k}"  # plain decoding has no K
        labels["method"].setText(f"{method_label(config)}{k}, {sampling_label(config.sampling, config.seed)}")
        labels["calibration"].setText(self._figures_text(config))
        if not labels["live"].text():
            labels["live"].setText("α — · — tok/s")

    def _figures_text(self, config) -> str:
        """The status bar's TPOT_plain (for the run shown, as every view has it) and c of the method."""
        shown = self.shown if self.shown is not None and self.shown.events else None
        plain = self.plain_tpot(shown)
        text = plain.label() if plain is not None else "TPOT_plain —"
        method = shown.config.method if shown is not None else config.method
        # a run's c comes from the calibration of the models it ran on (none for a replayed trace): the
        # models loaded now may have no draft at all
        c = figures.c_of(shown.calibration if shown is not None else self.calibration, method)
        if c is not None:
            text += f" · c {c:.2f} ({method})"
        speedup = figures.run_speedup(self.session.generations, shown, self.calibration)
        if speedup is not None and method != "none":
            text += f" · speedup {speedup:.2f}×"
        return text

    def _refresh_live(self, event) -> None:
        m = event.metrics
        alpha = f"α {m.acceptance_rate:.2f}" if m.drafted else "α —"
        self.status_labels["live"].setText(f"{alpha} · {m.tokens_per_s:.0f} tok/s")

    # ============================================================================================= closing
    def closeEvent(self, event) -> None:
        self.settings.save_layout(self.saveGeometry(), self.saveState())
        self.settings.set("view/plots", not self.plots_dock.isHidden())
        self.settings.sync()
        running, self.current = self.current, None
        for slot in self._decoder_slots + (self.load_slot, self.diagnosis_slot):
            slot.stop()
            job = slot.finish()  # joined here: its "done" handler never runs
            if slot is self.gen_slot and job is not None and running is not None:
                _take_waiting_rounds(job.worker, running)
        for gen in self.session.generations:  # a generation cut short by the close keeps its rounds
            if gen.finish is None:
                gen.finish = "stopped"
        self.keep_session()
        self.ui_timer.stop()
        super().closeEvent(event)


def _take_waiting_rounds(worker, gen: Generation) -> None:
    """The rounds a joined generation worker posted that the window had not taken yet: into gen."""
    while True:
        try:
            kind, args = worker.mailbox.get_nowait()
        except queue.Empty:
            return
        if kind == "event":
            gen.add(args[0])


# The decoding thread shares the GIL with this one. Qt calls release the GIL, and taking it back waits up to
# the switch interval while the decoder runs Python. With the default 5 ms, a plot repaint next to a busy
# Python thread took a median 34 ms instead of 2.4 ms; 0.5 ms brings it to 7.6 ms
# (scripts/plot_paint_bench.py, at tag before-house-cleanup).
GIL_SWITCH_INTERVAL_S = 0.0005


def run_gui(target: Optional[str] = None, draft: Optional[str] = None, device: str = "auto",
            open_trace: Optional[str] = None) -> int:
    """Open the window (main.py's default command), replaying `open_trace` (a saved JSONL trace) when given.
    Returns the application's exit code."""
    app = QApplication.instance() or QApplication(sys.argv)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    try:
        backend.preload_engine()
    except Exception:  # noqa: BLE001 - the window opens anyway; loading will report the engine's error
        pass
    app.aboutToQuit.connect(settle_clipboard)
    window = MainWindow(device=device)
    window.show()
    window.start(target, draft)
    if open_trace:
        window.open_trace(open_trace)
    return app.exec()
