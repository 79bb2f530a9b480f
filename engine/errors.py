"""User-facing errors: one clear line, never a traceback."""


class SpecplayError(Exception):
    """A problem the user can fix (bad input, missing model, no GPU). The CLI prints it and exits 2."""


class SpecplayWarning(UserWarning):
    """Something done on the user's behalf that they should know of (an input cut to a limit, a table left
    out): the CLI prints it after the command, as one line."""
