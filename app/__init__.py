"""The PySide6 GUI: main window, round view, live plots, workers, settings."""
from app.qt_compat import protect_singletons

protect_singletons()
