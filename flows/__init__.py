"""Prefect flows. Importing this package imports tasks/, which sets llmpipe's Prefect defaults (unless
already set) before prefect is first imported: flows sit above tasks, never the other way."""

import tasks  # noqa: F401
