"""Cloud backends: the same run on Modal (serverless GPUs) or SkyPilot (any cloud, on-prem).

- `modal_config.ModalConfig`: every Modal setting, one object; `modal_app.build_app` makes the App from it;
- `modal_backend.make_modal_backend`: `backend="modal"`; `modal_entry.modal_entrypoint`: `modal run examples/...`;
- `sky_backend.make_sky_backend`: `backend="sky"`, a `tinkerless serve` on a SkyPilot cluster; `sky_tasks`:
  the task files in `sky/` as `sky.Task`s, and the resumable managed-job command.
Both import their SDK lazily, so `import tinkerless` never needs modal or skypilot.
"""
