"""The OpenAI-compatible HTTP API (docs/architecture.md section 8), served by `pagedinfer serve`
beside gRPC over the same engine.

`protocol` holds the request and response bodies, `errors` OpenAI's error bodies,
`serving` what completions (`completions`) and chat (`chat`) share, `app` the FastAPI
routes and `http_server` the uvicorn server inside the gRPC server's event loop.
"""

from pagedinfer.service.openai.app import create_app
from pagedinfer.service.openai.http_server import HttpServer
from pagedinfer.service.openai.serving import ServingState

__all__ = ["HttpServer", "ServingState", "create_app"]
