"""The one error type of head training that means "the user asked for something unworkable"."""


class TrainHeadError(ValueError):
    """A bad option, a mismatched cache or checkpoint: shown as one line, never a traceback."""
