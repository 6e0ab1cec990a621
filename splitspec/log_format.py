"""One log line for every service and command: a date, a time to the millisecond, the level, the logger and the
message. `splitspec up` prefixes each service's lines with its name, so a deployment's logs read as one timeline
(uvicorn's own access and lifecycle lines keep uvicorn's format)."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def setup_logging(level: str) -> None:
    """The root logger at level (debug, info, warning, error), to stderr."""
    logging.basicConfig(level=getattr(logging, level.upper()), format=FORMAT, datefmt=DATE_FORMAT, stream=sys.stderr)
