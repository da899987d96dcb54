"""The tinkerless HTTP server: the worker's msgpack API over `POST /v1/call/{method}`.

- `create_app` / `serve` / `serve_in_thread`: the FastAPI app, run by uvicorn;
- `keys.KeyStore`: API keys, stored hashed; `tenancy`: per-tenant scoping of policy names.
FastAPI and uvicorn load only when this package is imported (extra `serve`).
"""

from tinkerless.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app, serve, serve_in_thread

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "create_app", "serve", "serve_in_thread"]
