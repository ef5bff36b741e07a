"""The data layer's one error type, apart so that every data module can raise it."""


class DataError(ValueError):
    """Bad data or data config: the message is one line naming the file or key and the fix."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a
    one-line DataError quotes of a library's error."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
