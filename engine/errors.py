"""User-facing errors: one clear line, never a traceback."""


class SpecplayError(Exception):
    """A problem the user can fix (bad input, missing model, no GPU). The CLI prints it and exits 2."""
