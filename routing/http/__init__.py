"""The OpenAI-compatible HTTP gateway: an ASGI app (Starlette on uvicorn) in front of the router.

    python -m routing.http --router tcp://127.0.0.1:5555 --http 127.0.0.1:8000

- app.py      routes, request lifecycle (disconnects cancel), errors as OpenAI error objects
- openai.py   OpenAI request bodies -> router requests; router answers -> OpenAI objects (pure)
- metrics.py  Prometheus metrics of one gateway (its own registry)
- server.py   GatewayConfig, bind and API-key checks, uvicorn in a thread or in the foreground, CLI
"""
