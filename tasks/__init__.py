"""Prefect tasks, one thin task per stage (tasks.stages). Importing this package (flows/ does, first)
sets llmpipe's Prefect defaults (unless already set) before prefect is first imported."""

import os
from pathlib import Path

# Prefect reads these when it is first imported: keep its state in the project, analytics off,
# and llmpipe's own log lines (training progress, ATC output) in the flow-run log.
os.environ.setdefault("PREFECT_HOME", str(Path.cwd() / ".prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "llmpipe")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
