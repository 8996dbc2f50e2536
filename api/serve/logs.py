"""Log setup: plain text for a terminal, one JSON object per line for log pipelines."""

from __future__ import annotations

import json
import logging
import sys
import time

#: Third-party loggers whose info lines are chatter, quiet above --log-level debug:
#: a line per request (uvicorn's access log; httpx and httpcore, for every request
#: kvindex makes, each pod /metrics scrape included) or per lifecycle step uvicorn
#: takes (kvindex logs its own start and shutdown). Their warnings and errors stay.
CHATTY_LOGGERS = ("uvicorn.access", "uvicorn.error", "httpx", "httpcore")

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    chatter = logging.DEBUG if level.lower() == "debug" else logging.WARNING
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(chatter)
