"""`tinkerless serve`: one model tenants train on (and extra ones beside it), many tenants, two APIs over HTTP.

- `create_app` (`app`) / `serve` / `serve_in_thread` (`serving`): the FastAPI app, run by uvicorn. It speaks the
  worker's msgpack API (`POST /v1/call/{method}`) and the Tinker API (`/api/v1/...`,
  `tinker_api`) for the official `tinker` SDK, and hosts the runs clients drive through it
  (`runs.RunService`: coordinator and checkpoints, `POST /v1/runs/...`);
- `served_models.ServedModels`: the main model and the extra base models held beside it (`--also-model`), which
  answer forward and sample (a teacher of another base) through the same keys, limits, scheduler and budgets;
- `scheduler.Scheduler`: one model, calls in each client's sequence order, tenants in turn, 429 when full;
  `streams`: that per-client sequence order (calls held until their predecessors arrive, gaps skipped);
- `stats.ServerStats`: the `/metrics` counters (Prometheus text);
- `keys.KeyStore`: API keys, stored hashed, with their budgets; `budgets.KeyBudgets`: what each key spent,
  reserved before a call's work and settled after it (402 past its budget); `run_budgets.RunBudgets`: the same
  for each hosted run's own limits (its config's max_compute_seconds / max_cost_usd); `tenancy`: per-tenant
  scoping of policy names.
FastAPI and uvicorn load only when this package is imported (extra `serve`).
"""

from tinkerless.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from tinkerless.server.serving import serve, serve_in_thread

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "create_app", "serve", "serve_in_thread"]
