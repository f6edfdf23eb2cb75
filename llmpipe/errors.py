"""The one base class of user errors.

A `UserError` is a failure the user can act on (a bad config field, an unusable corpus, a folder that
cannot be loaded); its message is one line and is shown as `error: <message>`, never as a traceback.
Each module raises its own subclass, naming the cause (config.ConfigError, data.errors.DataError,
stages.StageError, ...). Anything else (a bug, inside llmpipe or inside torch) stays a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure the user can act on; the message is one line."""

    transient = False  # whether a retry could succeed (see llmpipe.stages.is_transient)


class ConfigError(UserError, ValueError):
    """A user error in a config file or override; the message is one line meant for the user.
    (Defined here, not in llmpipe.config, so the checks config.py runs import no config.)"""


class StageError(UserError, RuntimeError):
    """A stage failed for a reason the user can act on; the message is one line.

    `transient=True` marks failures worth retrying (a rank killed from outside, a lost connection);
    everything else (bad config, bad data, a bug) fails the same way again and is never retried.
    """

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient
