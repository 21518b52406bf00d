"""The error types of a user's mistake (a bad option, a missing or broken file), as opposed to a bug.

Commands print a ``UserError`` as one line (``sparse-rl <command>: error: <message>``, exit status 2) instead
of a traceback (``cli.py``). The message names the option, field or file and, where there is a choice, the
valid values. ``utils.config_io.ConfigError`` is one. A ``UsageError`` is a bad command-line option: the CLI
prints the command's usage line before it, as argparse does for the errors it finds itself. A ``RunFailed`` is a
fault of the run's environment (a dead process, a damaged file), printed the same way with exit status 1. A
``StoppedEarly`` is a stop the user asked for before there was anything to save: one line, without "error", exit 0.
"""
from __future__ import annotations

import argparse


class UserError(Exception):
    """Something the user asked for cannot be done as asked; the message says what to change."""

    exit_code = 2


class RunFailed(UserError):
    """The run cannot go on for a reason outside the code: an engine process died, an engine server stopped
    answering, a checkpoint is damaged, the disk is full. Printed as one line like a ``UserError`` (the message
    says what failed, where, and what was kept), but exit status 1: a failure, not a mistake in the command."""

    exit_code = 1


class StoppedEarly(UserError):
    """The run was asked to stop (a signal, the ``STOP`` file) while it was still setting up, before it had anything
    to save (e.g. during a task's supervised warm start): one line saying where it stopped and what a re-run does,
    exit status 0, as for any stop that was asked for."""

    exit_code = 0


class UsageError(UserError):
    """A command-line option (or a combination of options) that cannot work; the message names the option."""


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1 (argparse reports ``argument --x: must be an integer >= 1, got '0'``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got '{text}'")
    return value
