"""What operators, load balancers and routers read: liveness, readiness, load, metrics
and the engine's state (docs/scale-out.md, docs/observability.md)."""

from __future__ import annotations

import attrs
from quart import Blueprint, Response

from butter.server.readiness import LIVE_PATH, READY_PATH, current_load
from butter.server.routes.common import json_response, model_card, served
from butter.version import __version__

routes = Blueprint("probes", __name__)
OPEN_PATHS = (LIVE_PATH, READY_PATH)  # open to every caller: load balancers, kubelets


@routes.get(LIVE_PATH)
async def health() -> Response:
    return Response("ok", mimetype="text/plain")


@routes.get(READY_PATH)
async def ready() -> Response:
    state = served().readiness.state()
    return json_response(state.body(), status=200 if state.ready else 503)


@routes.get("/get_load")
async def get_load() -> Response:
    """vllm-router's power_of_two polls this for each replica's load."""
    return json_response({"load": current_load(served().holder)})


@routes.get("/metrics")
async def prometheus_metrics() -> Response:
    return Response(served().metrics.render(), mimetype="text/plain; version=0.0.4")


@routes.get("/v1/server")
@routes.get("/server")
async def server_info() -> Response:
    """The engine's state. Answers at once, a swap or not: between its unload and load no
    model is resident."""
    holder = served().holder
    resident = holder.resident
    return json_response({
        "version": __version__,
        "model": model_card(resident) if resident else None,
        "engine": attrs.asdict(resident.engine.stats()) if resident else None,
        "prefix_cache": resident.prefix_cache_info() if resident else None,
        "speculation": resident.speculation_info() if resident else None,
        "swapping": holder.swapping,
        "swaps": holder.swaps,
        "allow_swap": holder.allow_swap,
    })
