"""The tinkerless HTTP server: the worker's msgpack API over `POST /v1/call/{method}`.

FastAPI and uvicorn load only when this package is imported (extra `serve`).
"""

from tinkerless.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app, serve

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "create_app", "serve"]
