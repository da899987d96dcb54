"""The Tinker API: lets the official `tinker` SDK (0.38.x) train and sample on `tinkerless serve`.

`mount(app, worker, scheduler, store, tenant_of, ...)` adds the `/api/v1` routes to a
FastAPI app. Protobuf bodies use the SDK's own message classes, so the `tinker`
package must be installed on the server (`pip install 'tinkerless[serve]'`).
"""

from __future__ import annotations

from tinkerless.server.tinker_api.checkpoints import CheckpointRegistry, TinkerPath
from tinkerless.server.tinker_api.service import TinkerService


def mount(
    app, worker, scheduler, store, tenant_of, *, max_request_bytes: int, aliases: set[str] | None = None, stats=None,
    limits=None, extras: dict | None = None,
) -> TinkerService:
    """`extras`: the server's extra base models {id: worker} (`served_models`), sampling clients' base models too."""
    from tinkerless.server.tinker_api.routes import make_router

    service = TinkerService(worker, scheduler, CheckpointRegistry(store), aliases=aliases or set(), limits=limits,
                            extras=extras)
    app.include_router(make_router(service, tenant_of, max_request_bytes, stats))
    return service


__all__ = ["CheckpointRegistry", "TinkerPath", "TinkerService", "mount"]
