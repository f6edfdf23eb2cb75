"""Flow tests run against a real (ephemeral, SQLite) Prefect server kept in a temporary PREFECT_HOME."""

import os
import tempfile

# Must be set before prefect is first imported.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="llmpipe-prefect-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the server stop message otherwise hits a closed capture
