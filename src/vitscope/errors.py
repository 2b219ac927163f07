"""The errors vitscope raises for what a user gave it: settings, files, paths, checkpoints.

Each message is one line that says what was wrong, with which value, and what to do. The CLI prints a
`VitscopeError` as that line and exits with code 2; any other exception is a bug in vitscope and keeps
its traceback. Each kind also subclasses the built-in error a Python caller would expect (a bad setting
is a ValueError), so `except ValueError` in a user's code still catches it.
"""

from __future__ import annotations


class VitscopeError(Exception):
    """Something the user gave vitscope cannot be used; the message says what and what to do."""


class ConfigError(VitscopeError, ValueError):
    """A setting of the wrong type, out of its range, or at odds with another setting."""


class InputError(VitscopeError, ValueError):
    """A file or value given to vitscope does not fit what it was given for: a damaged or foreign checkpoint,
    a vocabulary another model was trained with, images of another size than the model reads."""
