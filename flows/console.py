"""What `llmpipe run` shows on the terminal: Prefect's progress lines, not its failure tracebacks.

When a stage fails, Prefect's engines log the exception with its traceback for the task run and
again for the flow run, then the CLI prints the one `error: ...` line a user can act on. On the
terminal the tracebacks bury that line, so they are filtered out of the console handler only: the
API handler (the Prefect UI and `prefect flow-run logs`) still receives every record in full, and
`llmpipe run --verbose` shows them on the terminal too.
"""

from __future__ import annotations

import logging

_ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class _HideEngineFailures(logging.Filter):
    """Drops ERROR records of the flow/task-run loggers (the failure reports and their tracebacks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.name.startswith(_ENGINE_LOGGERS))


def quiet_engine_failures() -> None:
    """Install the filter on the root logger's terminal handlers (Prefect's console handler, or the
    CLI's own stream handler when logging was configured first); idempotent."""
    from prefect.logging.handlers import APILogHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, APILogHandler) and not any(
                isinstance(f, _HideEngineFailures) for f in handler.filters):
            handler.addFilter(_HideEngineFailures())
