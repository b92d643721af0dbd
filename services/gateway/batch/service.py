"""The Batch API of one gateway, assembled: the shared database, the Files
and Batches HTTP handlers and the runner. `GatewayService` starts it with
the gateway and stops it first (README "Batch API")."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from aiohttp import web

from services.common.clock import Clock
from services.common.config import MeshConfig
from services.gateway.batch.batch_run import RunDeps
from services.gateway.batch.batches_api import BatchesApi, ReadJson
from services.gateway.batch.execute import LineExecutor
from services.gateway.batch.files_api import FilesApi
from services.gateway.batch.gate import Gate
from services.gateway.batch.metrics import BatchMetrics
from services.gateway.batch.pacing import Window
from services.gateway.batch.runner import BatchRunner
from services.gateway.batch.store import Database
from services.gateway.driver import GenerationDriver
from services.gateway.frontdoor import Frontdoor
from services.gateway.metrics import GatewayMetrics

__all__ = ["BatchService", "database_path"]


def database_path(config: MeshConfig) -> str:
    """`batch.database`, or <run_dir>/batch.sqlite3: one file per mesh."""
    return config.batch.database or str(Path(config.run_dir) / "batch.sqlite3")


class BatchService:
    def __init__(self, config: MeshConfig, frontdoor: Frontdoor, driver: GenerationDriver,
                 metrics: GatewayMetrics, clock: Clock, replica: int) -> None:
        settings = config.batch
        self.db = Database(database_path(config))
        self._frontdoor = frontdoor
        self._clock = clock
        self._config = settings
        self.gate = Gate(Window(settings.max_in_flight), clock)
        deps = RunDeps(settings, self.db, LineExecutor(frontdoor, driver), self.gate, BatchMetrics(metrics.registry),
                       clock)
        owner = f"gateway-{replica}/pid-{os.getpid()}/{secrets.token_hex(3)}"
        self.runner = BatchRunner(deps, frontdoor.keys, owner)

    def register(self, app: web.Application, read_json: ReadJson) -> None:
        FilesApi(self._frontdoor, self.db, self._config.max_file_bytes, self._clock).register(app)
        BatchesApi(self._frontdoor, self.db, self._config, self._clock, read_json).register(app)

    def start(self) -> None:
        self.runner.start()

    async def pause(self) -> None:
        """A drain: start no more lines; those in flight go on until `stop`."""
        self.gate.close()

    async def stop(self) -> None:
        self.gate.close()
        await self.runner.stop()
        self.db.close()
