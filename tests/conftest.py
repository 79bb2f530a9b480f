"""Shared pytest set-up. Qt runs offscreen so the GUI tests need no display."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--require-peers", action="store_true",
                     help="fail, never skip, a test whose real peer (the built llama-server) is missing: "
                          ".ci/run passes it after building the peers")
    parser.addoption("--fuzz-cases", type=int, default=None, metavar="N",
                     help="random cases per kernel in the GPU fuzz tests (default: each module's own)")


def pytest_configure(config):
    import fuzz

    fuzz.override = config.getoption("--fuzz-cases")


@pytest.fixture(scope="session", autouse=True)
def settled_clipboard():
    """After the session, the clipboard holds no mime data made in Python (see app.widgets.settle_clipboard):
    otherwise the process crashes in Qt's exit handlers after every test has passed."""
    yield
    import sys

    if "PySide6.QtGui" in sys.modules:
        from app.widgets import settle_clipboard

        settle_clipboard()


@pytest.fixture
def isolated_qsettings(tmp_path):
    """Point QSettings (INI, user scope) at a temp dir so tests never read or write the user's settings."""
    from PySide6.QtCore import QSettings

    path = tmp_path / "qsettings"
    path.mkdir()
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(path))
    return path


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """(target_dir, draft_dir): a tiny random Llama pair sharing one tokenizer, built once per session."""
    from tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))
