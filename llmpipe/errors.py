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
