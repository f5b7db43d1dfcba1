"""The Open Inference Protocol's routes (KServe v2), beside the OpenAI ones on the same listener,
so that `tritonclient.http` and KServe clients work unchanged.

    GET  /v2                                        server metadata
    GET  /v2/health/live                            200 while the listener answers
    GET  /v2/health/ready                           200 when every model has a version ready
    GET  /v2/models/{name}[/versions/{v}]           model metadata: its versions and tensors
    GET  /v2/models/{name}[/versions/{v}]/ready     200 when ready (any version, or the one named)
    POST /v2/models/{name}[/versions/{v}]/infer     the `infer` op (kserve.py is the codec)

Requests are admitted as the OpenAI routes' are (routes.py): the tenant from the API key (or
`mcpd-tenant`), `mcpd-priority`, `mcpd-timeout-ms`, `traceparent`. Metadata and readiness come from `status`:
the tensors a version takes are its workers' signatures, so the front-end never imports a handler.
Errors under /v2 have OIP's body (server.py asks `is_oip_path`).
"""
from __future__ import annotations

from aiohttp import web

import mcpd
from mcpd.http import kserve
from mcpd.http.errors import HttpError
from mcpd.http.routes import Routes
from mcpd.protocol import codes

PREFIX = "/v2"
EXTENSIONS = ["binary_tensor_data"]


def is_oip_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


class KServeRoutes:
    def __init__(self, routes: Routes):
        self.routes, self.link = routes, routes.link

    def add_to(self, app: web.Application) -> None:
        app.router.add_get(PREFIX, self.server_metadata)
        app.router.add_get(PREFIX + "/health/live", self.live)
        app.router.add_get(PREFIX + "/health/ready", self.ready)
        for model in (PREFIX + "/models/{name}", PREFIX + "/models/{name}/versions/{version}"):
            app.router.add_get(model, self.model_metadata)
            app.router.add_get(model + "/ready", self.model_ready)
            app.router.add_post(model + "/infer", self.infer)

    async def server_metadata(self, request: web.Request) -> web.Response:
        self.routes.request_header(request)   # the API key, as everywhere
        return _json({"name": "mcpd", "version": mcpd.__version__, "extensions": EXTENSIONS})

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        models = (await self._status(request))["models"]["models"]
        ready = all(_ready_versions(model) for model in models.values())
        return _json({"ready": ready}, 200 if ready else 503)

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, model, version = await self._model(request)
        versions = model["versions"]
        signature = versions[version or model.get("primary") or next(iter(versions))].get("signature") or {}
        return _json({"name": name, "versions": list(versions), "platform": "mcpd",
                      "inputs": _tensors(signature.get("inputs")), "outputs": _tensors(signature.get("outputs"))})

    async def model_ready(self, request: web.Request) -> web.Response:
        name, model, version = await self._model(request)
        ready_versions = _ready_versions(model)
        ready = version in ready_versions if version is not None else bool(ready_versions)
        return _json({"name": name, "ready": ready}, 200 if ready else 503)

    async def infer(self, request: web.Request) -> web.Response:
        header = self.routes.request_header(request)
        body = await self.routes.read_body(request)
        infer = kserve.infer_request(body, request.headers.get(kserve.HEADER_LENGTH), request.match_info["name"],
                                     request.match_info.get("version"))
        call = await self.link.start("infer", infer.args, header, infer.payload)   # may refuse: not yet in flight
        self.routes.inflight += 1
        try:
            result = await call.result()
        finally:
            self.routes.inflight -= 1
            call.abandon()   # a disconnect (the handler cancelled): stop it
        body, headers = kserve.infer_response(result, list(call.payload), infer)
        return web.Response(body=body, headers=headers)

    async def _status(self, request: web.Request) -> dict:
        tenant = {k: v for k, v in self.routes.request_header(request).items() if k == "tenant"}
        return await self.link.call("status", {}, tenant)

    async def _model(self, request: web.Request) -> tuple[str, dict, str | None]:
        """The named model's status (and version, if named); 404 UNKNOWN_MODEL when not served."""
        name, version = request.match_info["name"], request.match_info.get("version")
        model = (await self._status(request))["models"]["models"].get(name)
        if model is None:
            raise HttpError(404, f"the model {name[:100]!r} does not exist", codes.UNKNOWN_MODEL, "model")
        if version is not None and version not in model["versions"]:
            raise HttpError(404, f"the model {name[:100]!r} has no version {version[:100]!r}; it has "
                                 f"{', '.join(model['versions'])}", codes.UNKNOWN_MODEL, "version")
        return name, model, version


def _ready_versions(model: dict) -> list[str]:
    """The versions that are loaded and have a worker ready."""
    return [v for v, figures in model["versions"].items() if figures.get("loaded") and figures.get("workers")]


def _tensors(signature: dict | None) -> list[dict]:
    """A status signature's {name: {"datatype", "shape"}} as OIP's tensor metadata list."""
    return [{"name": name, "datatype": t["datatype"], "shape": t["shape"]} for name, t in (signature or {}).items()]


def _json(value: dict, status: int = 200) -> web.Response:
    return web.Response(body=kserve.encode_json(value), status=status, content_type="application/json")
