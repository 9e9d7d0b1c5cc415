"""The service subcommands of ``dflash-serve`` (``up``, ``bench``), registered on the CLI's parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_service_commands(sub: argparse._SubParsersAction, engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the service subcommands; ``engine_args`` adds the engine flags shared with ``generate``."""
