"""The error type of a user's mistake (a bad option, a missing or broken file), as opposed to a bug.

Commands print a ``UserError`` as one line (``sparse-rl <command>: error: <message>``, exit status 2) instead
of a traceback (``cli.py``). The message names the option, field or file and, where there is a choice, the
valid values. ``utils.config_io.ConfigError`` is one.
"""
from __future__ import annotations


class UserError(Exception):
    """Something the user asked for cannot be done as asked; the message says what to change."""

    exit_code = 2
