"""The data layer's one error type, apart so that every data module can raise it."""


class DataError(ValueError):
    """Bad data or data config: the message is one line naming the file or key and the fix."""
