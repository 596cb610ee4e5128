"""Logging, set up once per process: plain lines or JSON lines, tagged with the process name."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_configured = False


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": self.process_name,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def setup_logging(process_name: str, level: str = "info", json_lines: bool = False) -> None:
    """Configure the root logger for this process. Calling it again in the same process is a no-op."""
    global _configured
    if _configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter(process_name))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s {process_name}[{os.getpid()}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    _configured = True
