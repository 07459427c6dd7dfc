"""POST /v1/models/load and /v1/models/unload: models at run time (routing/lifecycle.py), behind
the gateway's API keys like every other path. Each answers when the change is done: the copies
serve, or are gone."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from routing import openai_objects, openai_requests
from routing.http.bodies import read_json


def model_admin_routes(gateway) -> list[Route]:
    async def change(request: Request, endpoint: str, parse, call, resolve: bool = False) -> Response:
        async def work(t0):
            args = parse(await read_json(request.scope, request.receive, gateway.settings.max_body_bytes,
                                         gateway.settings.body_idle_timeout))
            if resolve:  # `name:id` is that copy, checked against the model table as a request's model is
                args["model"] = (await gateway.target_for(args["model"], request.scope["path"])).router_model
            out = await call(**args)
            await gateway.models(refresh=True)  # the model table changed
            return openai_objects.model_copies(out, int(time.time())), str(args["model"])
        return await gateway.handle(endpoint, work)

    async def load(request: Request) -> Response:
        """{"model", "copies" (wanted in all, default 1), "pin"}: answered when every copy serves."""
        return await change(request, "load", openai_requests.load_args, gateway.client.load)

    async def unload(request: Request) -> Response:
        """{"model" (a name, or name:id), "copies" (default all)}: answered when they are gone."""
        return await change(request, "unload", openai_requests.unload_args, gateway.client.unload, resolve=True)

    return [Route("/v1/models/load", load, methods=["POST"]), Route("/v1/models/unload", unload, methods=["POST"])]
