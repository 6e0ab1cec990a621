"""One log line for every service and command: a date, a time to the millisecond, the level, the logger and the
message. `splitspec up` prefixes each service's lines with its name, so a deployment's logs read as one timeline
(the gateway's uvicorn logs through the same root logger)."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")  # every command's --log-level
FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _UvicornName(logging.Filter):
    """uvicorn logs its start, stop and warnings as "uvicorn.error" whatever their level: shown as "uvicorn"."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def setup_logging(level: str) -> None:
    """The root logger at level (debug, info, warning, error), to stderr."""
    logging.basicConfig(level=getattr(logging, level.upper()), format=FORMAT, datefmt=DATE_FORMAT, stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_UvicornName())
