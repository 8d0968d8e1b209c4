"""The one log format of every breakgraph process (the CLI's, the server's, the engine's), and
the start-up loggers that speak at the default level.

At the default level (warning) a user still sees what start-up is doing: the model loading,
the engine's summary (device, dtype, KV slots, context, running requests, the memory split,
the fraction an unset ``--mem-fraction-static`` took where not 0.85), the graph capture, the
warm-up and the extend attention FlashInfer serves; ``--log-level info`` adds the rest,
``error`` hides them.
"""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
DEFAULT_LOG_LEVEL = "warning"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# their INFO lines are start-up progress, once per start (none per request or per step)
STARTUP_LOGGERS = (
    "breakgraph.cli",
    "breakgraph.models.model_path",
    "breakgraph.models.loader",
    "breakgraph.models.gguf_loader",
    "breakgraph.engine.engine",
    "breakgraph.engine.memory",  # --mem-fraction-static auto taking 0.90
    "breakgraph.engine.memory_profile",
    "breakgraph.engine.model_runner",
    "breakgraph.engine.warmup",
    "breakgraph.graph.bank",
    "breakgraph.kernels.flashinfer_extend",  # which extend attention serves, once per shape
    "breakgraph.server.client",
)

_OURS = "_breakgraph_handler"


def configure_logging(level: str, process: str | None = None) -> None:
    """Log to stderr in ``FORMAT`` at ``level`` (one of ``LOG_LEVELS``); ``process`` tags a
    child process's lines (``[engine]``). Calling it again replaces its own handler only."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _OURS, True)
    tag = f"[{process}] " if process else ""
    handler.setFormatter(logging.Formatter(FORMAT.replace("%(name)s", tag + "%(name)s")))
    root.addHandler(handler)
    root.setLevel(level.upper())
    startup = logging.INFO if level.lower() == DEFAULT_LOG_LEVEL else logging.NOTSET
    for name in STARTUP_LOGGERS:
        logging.getLogger(name).setLevel(startup)
