class CastspecError(Exception):
    """An error caused by the user's input or environment; the CLI prints it as one line, no traceback."""
