"""Who calls the batch service: the users' API keys, checked as a gateway
checks them (the same `gateway.api_keys` and `gateway.api_keys_file`, the
same errors), and which models the mesh serves.

Only the key's id (the first 12 hex of its SHA-256) is stored with a batch;
the raw key is never kept: lines go to the gateways under the batch
service's internal credential plus that id (submit.py)."""

from __future__ import annotations

from collections.abc import Mapping

from services.common.config import MeshConfig
from services.common.openai_api.errors import ApiError, ErrorKind
from services.gateway.keys import KeyStore, Principal, api_key_from_headers

__all__ = ["Callers"]


class Callers:
    """Immutable after construction: shared by the handlers and the runner."""

    def __init__(self, config: MeshConfig) -> None:
        self.keys = KeyStore(config.gateway)
        self._models = tuple(m.name for m in config.models)

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        return self.keys.authenticate(api_key_from_headers(headers))

    def principal_for(self, key_id: str) -> Principal | None:
        return self.keys.principal_for(key_id)

    def check_model(self, principal: Principal, model: str) -> None:
        """404 for a model this mesh does not serve, 403 for one the key may not use."""
        if model not in self._models:
            raise ApiError(ErrorKind.NOT_FOUND, f"the model {model!r} does not exist; available models: "
                               f"{', '.join(self._models) or 'none'}", param="model", code="model_not_found")
        self.keys.check_model(principal, model)
