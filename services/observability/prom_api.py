"""A small client of Prometheus's HTTP API (`/api/v1/query`,
`/api/v1/query_range`, `/api/v1/rules`, `/api/v1/targets`), on urllib: what
the snapshot tool and the end-to-end tests ask a Prometheus."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

__all__ = ["PromError", "api", "query", "query_range"]


class PromError(Exception):
    """Prometheus answered with an error (a bad query), or not at all."""


def api(base_url: str, path: str, params: dict[str, str] | None = None, timeout: float = 30.0) -> Any:
    """`data` of a GET to /api/v1/PATH; PromError on `status: error`."""
    url = f"{base_url.rstrip('/')}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 400/422 carry the error JSON
        try:
            body = json.loads(exc.read())
        except ValueError:
            raise PromError(f"{path}: HTTP {exc.code}") from exc
    except (OSError, ValueError) as exc:
        raise PromError(f"{path}: {exc}") from exc
    if body.get("status") != "success":
        raise PromError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
    return body["data"]


def query(base_url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    """An instant query's result series (`metric`, `value`); [] when empty.
    A scalar result comes back as one series without labels."""
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    data = api(base_url, "query", params)
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    return list(data["result"])


def query_range(base_url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """A range query's series (`metric`, `values`)."""
    data = api(base_url, "query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                         "step": f"{step:g}"})
    return list(data["result"])
