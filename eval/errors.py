"""The eval stage's error for bad input (its own module, so that every eval module can raise it)."""


class EvalError(Exception):
    """An evaluation that cannot start (missing drafter, bad dataset name, ...), with the fix in the message."""
