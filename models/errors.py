"""The models' errors a user can fix, each with the fix in its message."""
from __future__ import annotations


class TargetError(Exception):
    """A target that cannot be loaded or used, with the fix in the message."""
