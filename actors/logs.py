"""This project's log lines: one handler for its loggers, in every process it starts (Ray actors, Serve replicas,
the command line), at the level ``DFLASH_LOG_LEVEL`` names (INFO by default)."""

from __future__ import annotations

import logging
import os
import sys
import traceback

LOG_LEVEL_ENV = "DFLASH_LOG_LEVEL"
PROJECT_LOGGERS = ("actors", "serve_app", "engine", "kv", "spec_decode", "dflash")
FORMAT = "%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s"


class _Formatter(logging.Formatter):
    def formatException(self, ei) -> str:
        # Serve's replicas (throughput mode) swap builtins.print for one that writes a tuple's repr to any file but
        # stdout and stderr; the stock formatter prints the traceback into a StringIO, which came out as
        # "('Traceback ...\n',)('  File ...',)". format_exception builds the same text without print.
        return "".join(traceback.format_exception(*ei)).rstrip("\n")


class _Handler(logging.StreamHandler):
    """The one handler of the project's loggers (its class tells a second call that it is there)."""


def _level(level: str | int | None) -> int:
    if level is None:
        level = os.environ.get(LOG_LEVEL_ENV) or "INFO"
    if isinstance(level, int):
        return level
    number = logging.getLevelName(level.strip().upper())
    if not isinstance(number, int):
        raise ValueError(f"{LOG_LEVEL_ENV}={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return number


def configure_logging(level: str | int | None = None) -> None:
    """Give the project's loggers one handler (time, level, logger, process id) at ``level``, else
    ``DFLASH_LOG_LEVEL``, else INFO. Calling it again only sets the level."""
    number = _level(level)
    handler = next((h for h in logging.getLogger(PROJECT_LOGGERS[0]).handlers if isinstance(h, _Handler)), None)
    if handler is None:
        # The process's own stderr, not sys.stderr: in a Serve replica (throughput mode) that is Serve's redirect
        # into its replica logger, whose file gets a record only when 1000 have gathered or an ERROR comes, and
        # which files each line as INFO. The real one is Ray's worker-*.err file, as for every other actor.
        handler = _Handler(sys.__stderr__ or sys.stderr)
        handler.setFormatter(_Formatter(FORMAT))
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(number)
        # Not also to the root logger, where a driver's or Ray's own handlers would print the record again.
        logger.propagate = False
        if handler not in logger.handlers:
            logger.addHandler(handler)


def configure_actor_logging() -> None:
    """``configure_logging`` in a Ray actor's process (a rank, a KV manager, a replica, a Serve deployment); a
    no-op elsewhere: a script or a test that builds a replica in its own process keeps its own logging set up."""
    ray = sys.modules.get("ray")      # not imported: no Ray worker
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        configure_logging()


def log_env() -> dict[str, str]:
    """``DFLASH_LOG_LEVEL`` as this process has it, for a runtime_env's env_vars (empty when unset)."""
    value = os.environ.get(LOG_LEVEL_ENV)
    return {LOG_LEVEL_ENV: value} if value else {}
