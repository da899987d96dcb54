"""`backend="sky"`: a `tinkerless serve` cluster launched (or reused) through SkyPilot, called over HTTP.

`make_sky_backend(model, cluster=..., gpu=...)` reuses the cluster when `sky.status` says it
is UP and `sky.queue` shows its server job alive; otherwise, once SkyPilot's enabled clouds
(what `sky check` found) show it can launch at all, it launches `sky/train.yaml` with
`sky.launch` (onto the same cluster when that is up but its server stopped when idle).
It then waits for the server's `/healthz` and hands every call to an `HTTPBackend`.

The API key is generated here and reaches the node only as a SkyPilot secret (redacted by
SkyPilot, read by the server from its environment). It is kept in a 0600 file so a later
process can reuse the cluster, and never logged. `SkyBackend.down()` (or `close()` with
`down_on_close=True`) tears the cluster down.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from tinkerless.cloud.sky_tasks import KEY_ENV, SERVER_JOB_PREFIX, also_models, build_task, task_config, task_path
from tinkerless.errors import ConfigError, RemoteError
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.wire.codec import PYTHON_VERSION

logger = logging.getLogger(__name__)

_CLUSTER_NAME = re.compile(r"[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?")  # SkyPilot's rule; also a safe key-file name
# Worker settings that `make_backend` passes to every backend; on a server they are the server's to set.
_SERVER_SIDE_OPTIONS = ("engine", "micro_batch_size", "dtype")


@dataclass
class SkyOptions:
    """Everything `make_sky_backend(**options)` accepts besides model, cluster, gpu and down_on_close."""

    port: int = 8000
    infra: str | None = None  # "aws", "gcp/us-central1", "k8s/CONTEXT", "ssh/POOL"; None: any enabled infra
    api_key: str | None = None  # default: a fresh key at launch; on reuse, the saved one or $TINKERLESS_API_KEY
    envs: dict[str, str] = field(default_factory=dict)  # extra task envs, e.g. {"EXTRAS": "serve,vllm"}
    also_models: list[str] = field(default_factory=list)  # more base models the server holds (a run's teacher: added)
    yaml: str | None = None  # default: sky/train.yaml of this checkout
    workdir: str | None = None  # default: this checkout
    # The server exits after `server_idle_minutes` without calls; the cluster, then idle, is torn
    # down `idle_minutes_to_autostop` later. An idle GPU bills for at most the sum.
    server_idle_minutes: float = 60.0
    idle_minutes_to_autostop: int | None = 10
    autodown: bool = True  # when idle: tear down (no disk billed) rather than stop
    retry_until_up: bool = False
    health_timeout: float = 1800.0  # a fresh node installs torch and loads the model before /healthz answers
    poll_interval: float = 5.0
    http_timeout: float = 600.0


class SkyBackend:
    """A Backend whose functions run on a SkyPilot cluster's `tinkerless serve`, over HTTP."""

    name = "sky"

    def __init__(self, cluster: str, url: str, http: HTTPBackend, *, down_on_close: bool = False):
        self.cluster = cluster
        self.url = url
        self.down_on_close = down_on_close
        self._http = http
        self.usage = http.usage  # the server's own timing of each call (X-Tinkerless-Compute-Seconds)
        self._closed = False

    @property
    def http(self) -> HTTPBackend:
        """The cluster's server's client (a teacher the server holds beside the model is called through it)."""
        return self._http

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        return self._http.call_bytes(method, payload)

    def run_host(self, local_dir: str = "."):
        """Runs through this backend live on the cluster's server, in its `--storage`."""
        return self._http.run_host(local_dir=local_dir)

    def close(self) -> None:
        """Stop talking to the cluster; tear it down only if this backend was made with down_on_close=True."""
        if self._closed:
            return
        self._closed = True
        self._http.close()
        if self.down_on_close:
            self.down()

    def down(self) -> None:
        """Tear the cluster down now (billing stops; whatever was on its disks is gone)."""
        self._closed = True
        self._http.close()
        down(self.cluster)

    def __repr__(self) -> str:
        return f"SkyBackend(cluster={self.cluster!r}, url={self.url!r})"


def make_sky_backend(
    model: str,
    *,
    cluster: str | None = None,
    gpu: str | None = None,
    down_on_close: bool = False,
    run_config: Any = None,
    **options: Any,
) -> SkyBackend:
    """Launch or reuse the SkyPilot cluster `cluster` serving `model`, wait until it is healthy, connect.

    `gpu` ("H100", "A100-80GB:1") replaces the YAML's list of acceptable GPUs; `options` are
    the fields of `SkyOptions`. `run_config` (the TrainConfig the cluster is launched for, as `train` passes it):
    before a launch, its estimate on each GPU class the launch accepts is printed (from the measured tables,
    nothing runs), since SkyPilot may pick any of them.
    """
    opts = _options(options)
    name = cluster or default_cluster_name(model)
    if not _CLUSTER_NAME.fullmatch(name):
        raise ConfigError(
            f"invalid SkyPilot cluster name {name!r}",
            hint="start with a letter; then letters, digits, '-', '_' or '.'; end with a letter or digit",
        )
    sky = import_sky()
    if _server_alive(sky, name):
        # The key this machine saved at launch, or the one a user launched with by hand (`--secret`).
        keys = [opts.api_key] if opts.api_key else [load_key(name), os.environ.get(KEY_ENV)]
        keys = [key for key in dict.fromkeys(keys) if key]
        if not keys:
            raise ConfigError(
                f"SkyPilot cluster {name!r} is up, but there is no API key for its server",
                hint=f"pass api_key=... or export {KEY_ENV}=<the key it was launched with>; "
                f"or tear it down with `sky down {name}` and launch again",
            )
        logger.info("reusing SkyPilot cluster %s (already UP)", name)
    else:
        _require_enabled_infra(sky, name, opts.infra)  # no key file, no launch, when nothing can start
        keys = [opts.api_key or new_api_key()]
        # Refuses GPUs the model cannot fit, before a key or a launch; a run's teacher of another base is held too.
        task = _task(model, gpu, opts, keys[0], also_models(model, opts.also_models, run_config))
        if run_config is not None:  # what the run will cost on what it may get, before anything is spent
            from tinkerless.sdk.run.estimate import before_launch

            print(f"launching SkyPilot cluster {name} for run {run_config.name!r}:\n"
                  f"{before_launch(run_config, _accepted_gpus(task))}", flush=True)
        save_key(name, keys[0])  # before launching: a launch that is interrupted still leaves a reusable cluster
        try:
            _launch(sky, task, name, opts)
        except BaseException:
            if not _cluster_exists(sky, name):  # nothing was provisioned: the key opens nothing
                key_file(name).unlink(missing_ok=True)
            raise
    url = _endpoint(sky, name, opts.port)
    wait_healthy(url, cluster=name, timeout=opts.health_timeout, interval=opts.poll_interval)
    key = _check_server(url, keys, model, name)
    return SkyBackend(name, url, HTTPBackend(url, api_key=key, timeout=opts.http_timeout), down_on_close=down_on_close)


def down(cluster: str) -> None:
    """Tear down a cluster made by `backend="sky"` (or `sky launch`) and forget its saved key."""
    sky = import_sky()
    logger.info("tearing down SkyPilot cluster %s", cluster)
    try:
        sky.get(sky.down(cluster))
    except sky.exceptions.ClusterDoesNotExist:
        logger.info("SkyPilot cluster %s was already gone", cluster)
    except Exception as exc:
        raise RemoteError(
            f"sky down {cluster} failed: {type(exc).__name__}: {exc}",
            hint=f"retry with `sky down {cluster}`, and check the cloud console that nothing is left running",
        ) from exc
    key_file(cluster).unlink(missing_ok=True)


# ---- SkyPilot calls (each returns a request id that sky.get / sky.stream_and_get resolves) ----


def import_sky() -> Any:
    try:
        import sky
    except ImportError as exc:
        raise ConfigError(f"backend='sky' needs SkyPilot ({exc})", hint="pip install 'tinkerless[sky]'") from exc
    return sky


def _server_alive(sky: Any, name: str) -> bool:
    """Whether cluster `name` is UP with its server job queued or running (not stopped when idle)."""
    try:
        records = sky.get(sky.status([name]))
    except Exception as exc:
        raise _sky_error(f"sky status {name} failed", exc, name) from exc
    if not any(_field(r, "name") == name and _field(r, "status") == sky.ClusterStatus.UP for r in records):
        return False
    try:
        jobs = sky.get(sky.queue(name, skip_finished=True))
    except Exception as exc:
        raise _sky_error(f"sky queue {name} failed", exc, name) from exc
    alive = any(
        str(_field(job, "job_name") or "").startswith(SERVER_JOB_PREFIX) and not _field(job, "status").is_terminal()
        for job in jobs
    )
    if not alive:
        logger.info("SkyPilot cluster %s is up but its server has stopped (idle, or crashed): starting it again", name)
    return alive


def _require_enabled_infra(sky: Any, name: str, infra: str | None) -> None:
    """ConfigError before any launch when SkyPilot has no enabled cloud (or not the one `infra` names).

    Asks SkyPilot's API for the clouds `sky check` enabled last; that answer is cached by SkyPilot
    (in its local API server), so no cloud is contacted here."""
    try:
        enabled = [str(cloud) for cloud in sky.get(_sdk(sky).enabled_clouds()) or []]
    except Exception as exc:
        raise _sky_error("asking SkyPilot for its enabled clouds failed", exc, name) from exc
    if not enabled:
        raise ConfigError(
            f"SkyPilot has no enabled cloud (as of its last `sky check`), so cluster {name} cannot be launched",
            hint="set up credentials for one (e.g. `aws configure`, `gcloud auth application-default login`, "
            "a kubeconfig, or ~/.sky/ssh_node_pools.yaml), then run `sky check` and retry",
        )
    if infra:
        wanted = infra.split("/", 1)[0].strip().lower()
        wanted = {"k8s": "kubernetes"}.get(wanted, wanted)
        if wanted not in ("", "*") and wanted not in {cloud.lower() for cloud in enabled}:
            raise ConfigError(
                f"infra={infra!r}: {wanted} is not among SkyPilot's enabled clouds ({', '.join(enabled)})",
                hint=f"run `sky check {wanted}` to see why it is disabled, or pick an enabled one",
            )


def _sdk(sky: Any) -> Any:
    """SkyPilot's client SDK module (the functions that `import sky` does not re-export, such as enabled_clouds)."""
    if hasattr(sky, "enabled_clouds"):
        return sky
    from sky.client import sdk

    return sdk


def _cluster_exists(sky: Any, name: str) -> bool:
    """Whether SkyPilot knows cluster `name` in any state; True when it cannot tell (keep what may be needed)."""
    try:
        return any(_field(r, "name") == name for r in sky.get(sky.status([name])))
    except Exception:
        return True


def _launch(sky: Any, task: Any, name: str, opts: SkyOptions) -> None:
    logger.info("launching SkyPilot cluster %s (provisioning and installing tinkerless take minutes)", name)
    try:
        request_id = sky.launch(
            task,
            cluster_name=name,
            idle_minutes_to_autostop=opts.idle_minutes_to_autostop,
            down=opts.autodown,
            retry_until_up=opts.retry_until_up,
        )
        sky.stream_and_get(request_id)  # SkyPilot's own provisioning log; secrets are redacted there
    except Exception as exc:
        raise _sky_error(f"sky launch of cluster {name} failed", exc, name) from exc


def _endpoint(sky: Any, name: str, port: int) -> str:
    try:
        endpoints = sky.get(sky.endpoints(name, port))
    except Exception as exc:
        raise _sky_error(f"cannot get the endpoint of port {port} on cluster {name}", exc, name) from exc
    endpoint = (endpoints or {}).get(port) or (endpoints or {}).get(str(port))
    if not endpoint:
        raise RemoteError(
            f"cluster {name} exposes no endpoint for port {port} (got {endpoints!r})",
            hint=f"the task must open it (resources.ports: {port}); see `sky status --endpoints {name}`",
        )
    return endpoint.rstrip("/") if "://" in endpoint else f"http://{endpoint.rstrip('/')}"


def _sky_error(what: str, exc: Exception, name: str) -> Exception:
    sky = sys.modules.get("sky")
    no_cloud = sky is not None and isinstance(exc, (sky.exceptions.NoCloudAccessError, sky.exceptions.InvalidCloudCredentials))
    if no_cloud:
        return ConfigError(
            f"{what}: SkyPilot can reach no cloud or cluster ({type(exc).__name__}: {exc})",
            hint="run `sky check` to see which infra is enabled and why not; set up credentials for one, then retry",
        )
    if sky is not None and isinstance(exc, sky.exceptions.ApiServerConnectionError):
        return RemoteError(f"{what}: the SkyPilot API server is unreachable ({exc})", hint="check it with `sky api status`")
    return RemoteError(
        f"{what}: {type(exc).__name__}: {exc}",
        hint=f"run `sky check` to see which infra is enabled; `sky logs --provision {name}` shows what happened",
    )


def _field(record: Any, name: str) -> Any:
    return record[name] if isinstance(record, dict) else getattr(record, name, None)


# ---- the task, the key and the server -----------------------------------------------------


def _task(model: str, gpu: str | None, opts: SkyOptions, key: str, also: str = "") -> Any:
    envs = {
        "MODEL": model,
        **({"ALSO_MODELS": also} if also else {}),  # a run's teacher of another base, held beside the model
        "PYTHON_VERSION": PYTHON_VERSION,  # the server unpickles this client's code
        "IDLE_MINUTES": f"{opts.server_idle_minutes:g}",
        **opts.envs,
    }
    config = task_config(
        opts.yaml or task_path("train"), envs=envs, accelerators=gpu, port=opts.port, infra=opts.infra, workdir=opts.workdir
    )
    from tinkerless.cloud.preflight import check_sky

    # The memory preflight (docs/scaling.md): GPU options that cannot hold the model are dropped, none is an error.
    resources = config["resources"]
    if resources.get("accelerators") is not None:
        resources["accelerators"] = check_sky(model, resources["accelerators"], dtype=opts.envs.get("DTYPE", "auto"))
    return build_task(config, secrets={KEY_ENV: key})


def _accepted_gpus(task: Any) -> list[str]:
    """The GPU classes a task's resources accept (any of them may be what SkyPilot launches)."""
    return list(dict.fromkeys(name for resources in task.resources for name in (resources.accelerators or {})))


def default_cluster_name(model: str) -> str:
    """`tinkerless-<model>`, within SkyPilot's cluster-name rules (letters, digits, '-'; short)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.rsplit("/", 1)[-1].lower()).strip("-")[:24].strip("-")
    return f"tinkerless-{slug}" if slug else "tinkerless"


def new_api_key() -> str:
    """A key in the `tml-` format the server and the Tinker SDK accept."""
    return f"tml-sky{secrets.token_hex(3)}-{secrets.token_urlsafe(24)}"


def key_file(cluster: str) -> Path:
    home = Path(os.environ.get("TINKERLESS_HOME") or Path.home() / ".tinkerless")
    return home / "sky" / f"{cluster}.key"


def save_key(cluster: str, key: str) -> None:
    path = key_file(cluster)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others, not even briefly
    with os.fdopen(descriptor, "w") as handle:
        handle.write(key)


def load_key(cluster: str) -> str | None:
    try:
        return key_file(cluster).read_text().strip() or None
    except FileNotFoundError:
        return None


def wait_healthy(url: str, *, cluster: str, timeout: float, interval: float = 5.0) -> None:
    """Poll `url/healthz` until it answers {"status": "ok"}; RemoteError naming the URL and the log command if not."""
    deadline = time.monotonic() + timeout
    logger.info("waiting up to %.0fs for %s/healthz", timeout, url)
    last = "no answer yet"
    while True:
        remaining = deadline - time.monotonic()
        try:
            response = httpx.get(f"{url}/healthz", timeout=max(1.0, min(10.0, remaining)))
            body = response.json() if response.status_code == 200 else None
            if isinstance(body, dict) and body.get("status") == "ok":
                return
            last = f"HTTP {response.status_code}: {response.text[:100]!r}"
        except (httpx.HTTPError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() + interval > deadline:
            raise RemoteError(
                f"the tinkerless server at {url} did not become healthy within {timeout:.0f}s (last: {last})",
                hint=f"see why in its log: `sky logs {cluster}` (setup installs torch and loads the model; "
                f"raise health_timeout= if it is still going), or tear it down with `sky down {cluster}`",
            )
        time.sleep(interval)


def _check_server(url: str, keys: list[str], model: str, cluster: str) -> str:
    """The first of `keys` the server accepts; it must serve `model` (a reused cluster may hold another)."""
    for key in keys:
        try:
            info = httpx.get(f"{url}/healthz", headers={"Authorization": f"Bearer {key}"}, timeout=30.0).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RemoteError(f"{url}/healthz failed after answering once: {exc}", hint=f"see `sky logs {cluster}`") from exc
        if isinstance(info, dict) and "model" in info:  # the bare probe answer goes to callers without a valid key
            break
    else:
        raise ConfigError(
            f"the server on cluster {cluster} ({url}) does not accept this API key",
            hint=f"pass the key it was launched with (api_key=... or {KEY_ENV}), or `sky down {cluster}` and launch again",
        )
    if info["model"] != model:
        raise ConfigError(
            f"cluster {cluster} serves model {info['model']!r}, not {model!r}",
            hint=f"pick another cluster name (cluster=...), or `sky down {cluster}` and launch again",
        )
    return key


def _options(options: dict[str, Any]) -> SkyOptions:
    known = {f.name for f in fields(SkyOptions)}
    unknown = sorted(set(options) - known - set(_SERVER_SIDE_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for backend='sky'", hint=f"known: {', '.join(sorted(known))}")
    return SkyOptions(**{k: v for k, v in options.items() if k in known})


__all__ = ["SkyBackend", "SkyOptions", "down", "make_sky_backend"]
