"""Errors of the training stage that come from bad input; the console scripts show them as one line."""


class TrainError(Exception):
    """A training run that cannot start, with the fix in the message."""
