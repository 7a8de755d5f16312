"""The engine core inside a Ray actor: the engine process's own loop (`core_process.run_core`).

Ray imports this module in the actor's worker process, so it names nothing of the front end (no FastAPI,
no serving) and nothing of Ray: `RayCoreClient` wraps the class with `ray.remote` when it places one.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from tokenloop.core.core_process import run_core

if TYPE_CHECKING:
    from tokenloop.config import EngineConfig
    from tokenloop.model.loader import Checkpoint


class CoreActor:
    """One replica's engine core. `serve` runs for the core's whole life; its result (or its failure)
    is how the front end learns that the core stopped."""

    def pid(self) -> int:
        return os.getpid()

    def serve(self, config: EngineConfig, checkpoint: Checkpoint | None, input_address: str,
              output_address: str, log_level: int = logging.INFO,
              heartbeat: tuple[str, float] | None = None) -> int:
        """Build the core, connect to the front end's sockets and serve until `Shutdown`: 0, or 1 if
        building failed (the reason went out as `CoreReady.error`). `heartbeat`: (address, interval)."""
        logging.getLogger("tokenloop").setLevel(log_level)
        # Nothing to watch for here: Ray kills a (non-detached) actor when its owner, the front end's
        # driver, dies, as the engine process's parent-pid check does for it.
        return run_core(config, checkpoint, input_address, output_address, should_stop=lambda: False,
                        heartbeat=heartbeat)
