"""What every transport of one gateway is built on: the request pipeline,
the scheduler client (health), the metrics, the served-models view and the
tokenize routes. `server.py` builds it once; `http_api.HttpApi` and
`grpc_api.InferenceApi` each hold it, so neither repeats the other's wiring."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.frontdoor import Frontdoor
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import RequestPipeline
from services.gateway.scheduler_replicas import SchedulerReplicas
from services.gateway.served_models import ServedModels
from services.gateway.tokenize_api import TokenizeApi

__all__ = ["TransportParts"]


@dataclass
class TransportParts:
    pipeline: RequestPipeline
    scheduler: SchedulerReplicas
    metrics: GatewayMetrics
    served: ServedModels   # one cached view of the served models for every transport
    tokenize: TokenizeApi = field(init=False)

    def __post_init__(self) -> None:
        self.tokenize = TokenizeApi(self.pipeline.frontdoor)

    @property
    def frontdoor(self) -> Frontdoor:
        return self.pipeline.frontdoor
