"""Prefect tasks, one thin task per stage (tasks.stages). Importing this package imports flows, which
sets llmpipe's Prefect defaults before prefect is first imported."""

import flows  # noqa: F401
