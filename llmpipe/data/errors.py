"""Errors of the data readers (they do not import the stage mechanism)."""

from __future__ import annotations

from llmpipe.errors import UserError


class DataError(UserError, ValueError):
    """Unusable input data or tokenizer: the message names the field or file and what is wrong."""
