"""The Tinker service: sessions, training models, samplers and futures over one tinkerless Worker.

Framework-free (the FastAPI routes in `routes.py` are thin glue). Every call that
touches the model is a job on the shared `Scheduler`: a training model's calls
form one stream ordered by the SDK's `seq_id`; tenants take turns.

Ids follow the hosted service: sessions `sess-<hex>`, training models (= training
runs) `<session>:train:<n>`, samplers `<session>:sample:<n>`, checkpoints
`tinker://<run>/weights/<name>` and `tinker://<run>/sampler_weights/<name>`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tinkerless.errors import UserError
from tinkerless.server.limits import ServingLimits
from tinkerless.server.scheduler import Scheduler
from tinkerless.server.tenancy import tenant_prefix
from tinkerless.server.tinker_api import convert
from tinkerless.server.tinker_api.prompt_scores import PromptScoring
from tinkerless.server.tinker_api.checkpoints import CheckpointRegistry, TinkerPath, check_name, now_iso
from tinkerless.wire.validate import validate
from tinkerless.wire.messages import (
    BASE_POLICY,
    AdamParams,
    CreatePolicyRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    LoraConfig,
    OptimStepRequest,
    PolicyState,
    SampleRequest,
    SaveStateRequest,
)

FUTURE_TTL = 3600.0  # seconds a finished result stays retrievable
MAX_SNAPSHOT_SLOTS = 4  # sampler snapshots kept loaded as adapters on the worker
KEEP_EPHEMERAL = 8  # ephemeral sampler weights kept per training model


@dataclass
class Proto:
    """A result the SDK expects as protobuf bytes."""

    data: bytes


@dataclass
class TrainingModel:
    model_id: str
    tenant: str
    policy: str  # the worker's adapter name
    base_model: str
    lora_rank: int
    user_metadata: dict | None
    created_at: str = field(default_factory=now_iso)
    last_request_time: str = field(default_factory=now_iso)
    last_checkpoint: dict | None = None
    last_sampler_checkpoint: dict | None = None
    lora_flags: dict = field(default_factory=dict)  # train_attn / train_mlp / train_unembed, for weights_info

    def record(self) -> dict:
        return {
            "training_run_id": self.model_id,
            "base_model": self.base_model,
            "model_owner": self.tenant or "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": self.lora_rank,
            "last_request_time": self.last_request_time,
            "last_checkpoint": self.last_checkpoint,
            "last_sampler_checkpoint": self.last_sampler_checkpoint,
            "user_metadata": self.user_metadata,
            "created_at": self.created_at,
        }


@dataclass
class Sampler:
    sampler_id: str
    tenant: str
    base_model: str
    model_path: str | None = None
    live: tuple[str, int] | None = None  # (training model id, policy version) the weights were taken at
    state: PolicyState | None = None  # the adapter, when it may differ from the live model's


class TinkerService:
    def __init__(
        self, worker, scheduler: Scheduler, registry: CheckpointRegistry, *, aliases: set[str],
        limits: ServingLimits | None = None,
    ):
        self.worker = worker
        self.scheduler = scheduler
        self.registry = registry
        from tinkerless.functions.models import model_aliases, public_model_id

        # Clients see the Hub id (their tokenizer loads from it); the short aliases are accepted too.
        self.base_model = public_model_id(worker.model_name)
        self.aliases = aliases | model_aliases(worker.model_name)
        self.limits = limits or ServingLimits()
        self._lock = threading.Lock()
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self._ephemeral: dict[str, list[str]] = {}  # model id -> its ephemeral sampler ids, oldest first
        self._slots: OrderedDict[str, str] = OrderedDict()  # snapshot key -> worker policy, LRU order
        self._slots_in_use: dict[str, int] = {}  # slot -> samples using it (paused between slices, too)
        self.futures: dict[str, tuple[str, concurrent.futures.Future, float]] = {}
        self._ids = itertools.count(1)
        self._sequence_ids = itertools.count()

    # -- sessions -------------------------------------------------------------------

    def create_session(self, tenant: str, body: dict) -> dict:
        session_id = f"sess-{secrets.token_hex(8)}"
        with self._lock:
            self.sessions[session_id] = {"tenant": tenant, "tags": body.get("tags") or [], "alive": True,
                                         "user_metadata": body.get("user_metadata"), "display_name": body.get("display_name")}
        return {"session_id": session_id, "type": "create_session"}

    def session(self, tenant: str, session_id: str) -> dict:
        record = self.sessions.get(session_id)
        if record is None or record["tenant"] != tenant:
            raise UserError(f"unknown session {session_id!r}", hint="create a new ServiceClient")
        return record

    # -- futures --------------------------------------------------------------------

    def submit(
        self, tenant: str, fn: Callable[[], Any], *, stream: str | None = None, seq: int | None = None, **extra
    ) -> dict:
        future = self.scheduler.submit(fn, tenant=tenant, stream=stream, seq=seq)
        request_id = f"req-{next(self._ids)}-{secrets.token_hex(6)}"
        with self._lock:
            self._expire_futures()
            self.futures[request_id] = (tenant, future, time.monotonic())
        return {"request_id": request_id, **extra}

    def future(self, tenant: str, request_id: str) -> concurrent.futures.Future:
        entry = self.futures.get(request_id)
        if entry is None or entry[0] != tenant:
            raise KeyError(request_id)
        return entry[1]

    def _expire_futures(self) -> None:
        cutoff = time.monotonic() - FUTURE_TTL
        for rid in [r for r, (_, f, t) in self.futures.items() if f.done() and t < cutoff]:
            del self.futures[rid]

    # -- training models ------------------------------------------------------------------

    def _check_base_model(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in self.aliases:
            raise UserError(
                f"this server serves {self.base_model!r}, not {base_model!r}",
                hint=f"pass base_model={self.base_model!r} (the server's --model), or start a server for that model",
            )

    def model(self, tenant: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            raise UserError(f"unknown model {model_id!r}", hint="create it with create_lora_training_client first")
        model.last_request_time = now_iso()
        return model

    def _new_model(self, tenant: str, session_id: str, model_seq_id: int, base_model: str | None, metadata) -> TrainingModel:
        self.session(tenant, session_id)
        self._check_base_model(base_model)
        if isinstance(model_seq_id, bool) or not isinstance(model_seq_id, int) or not 0 <= model_seq_id < 2**63:
            raise UserError(f"model_seq_id must be an integer in [0, 2**63), got {str(model_seq_id)[:32]!r}")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise UserError(f"model {model_id} already exists", hint="use a new model_seq_id")
        policy = tenant_prefix(tenant) + "tk" + hashlib.sha256(model_id.encode()).hexdigest()[:16]
        return TrainingModel(model_id, tenant, policy, self.base_model, 0, metadata)

    def create_model(self, tenant: str, body: dict) -> dict:
        optimizer = convert.options(body, "optimizer_config").get("type", "adamw")
        if optimizer != "adamw":
            raise UserError(f"optimizer {optimizer!r} is not supported", hint="this server trains with adamw")
        model = self._new_model(tenant, body["session_id"], body["model_seq_id"], body.get("base_model"), body.get("user_metadata"))
        lora = convert.options(body, "lora_config")
        rank = int(lora.get("rank", 32))
        if not 1 <= rank <= 256:
            raise UserError(f"lora rank {rank} is out of range", hint="use a rank between 1 and 256")
        model.lora_rank = rank
        targets = convert.lora_target_modules(lora)
        model.lora_flags = {k: bool(lora.get(k, True)) for k in ("train_attn", "train_mlp", "train_unembed")}
        seed = lora.get("seed")
        seed = int(seed) if seed is not None else secrets.randbelow(2**31)  # the SDK: None means a random init
        config = validate(LoraConfig(rank=rank, alpha=32, target_modules=targets, seed=seed))

        def run() -> dict:
            self.worker.create_policy(CreatePolicyRequest(model.policy, config))
            self._register(model)
            return {"model_id": model.model_id, "type": "create_model"}

        return self.submit(tenant, run, model_id=model.model_id)

    def _register(self, model: TrainingModel) -> None:
        with self._lock:
            self.models[model.model_id] = model
        self.registry.save_run(model.tenant, model.record())

    def get_info(self, tenant: str, body: dict) -> dict:
        model = self.model(tenant, body["model_id"])
        # tokenizer_id is what the client's AutoTokenizer loads: the Hub id, never a path on this server.
        return {
            "model_id": model.model_id,
            "model_data": {"arch": "lora", "model_name": model.base_model, "tokenizer_id": model.base_model},
            "is_lora": True,
            "lora_rank": model.lora_rank,
            "model_name": model.base_model,
            "type": "get_info",
        }

    def forward_backward(self, tenant: str, body: bytes) -> dict:
        model_id, seq_id, loss_fn, config, forward_only, raw = convert.parse_forward_backward(body)
        model = self.model(tenant, model_id)

        def run() -> Proto:  # checked in here: a refused call must still use up its place in the model's order
            loss = convert.loss_config(loss_fn, config)
            data = [convert.to_datum(i, tokens, inputs, loss_fn) for i, (tokens, inputs) in enumerate(raw)]
            if not data:
                raise UserError("forward_backward got no data", hint="send at least one Datum")
            validate(ForwardBackwardRequest(model.policy, data, loss), vocab_size=self.worker.vocab_size)
            if forward_only:
                logprobs = self.worker.forward(ForwardRequest(model.policy, data)).logprobs
                metrics = {"loss": _loss_value(loss, data, logprobs)}
            else:
                result = self.worker.forward_backward(ForwardBackwardRequest(model.policy, data, loss))
                metrics, logprobs = result.metrics, result.logprobs
            return Proto(convert.forward_backward_output([lp[1:] for lp in logprobs], convert.tinker_metrics(metrics, len(data))))

        return self.submit(tenant, run, stream=model.model_id, seq=seq_id, model_id=model.model_id)

    def optim_step(self, tenant: str, body: dict) -> dict:
        model = self.model(tenant, body["model_id"])
        p = convert.options(body, "adam_params")
        adam = AdamParams(
            learning_rate=float(p.get("learning_rate", 1e-4)),
            beta1=float(p.get("beta1", 0.9)),
            beta2=float(p.get("beta2", 0.95)),
            eps=float(p.get("eps", 1e-12)),
            weight_decay=float(p.get("weight_decay", 0.0)),
            grad_clip_norm=float(p.get("grad_clip_norm", 0.0)),
        )

        def run() -> dict:
            validate(adam)  # here, not before queueing: a refused call must still use up its place in the order
            result = self.worker.optim_step(OptimStepRequest(model.policy, adam))
            return {"metrics": {"grad_norm:mean": result.metrics["grad_norm"], "learning_rate:mean": adam.learning_rate}}

        return self.submit(tenant, run, stream=model.model_id, seq=body.get("seq_id"), model_id=model.model_id)

    def save_weights(self, tenant: str, body: dict) -> dict:
        model = self.model(tenant, body["model_id"])
        path = TinkerPath(model.model_id, "weights", check_name(body["path"]))

        def run() -> dict:
            state = self.worker.save_state(SaveStateRequest(model.policy, include_optimizer=True))
            meta = self._store(model, path, state, body.get("user_metadata"))
            model.last_checkpoint = _public(meta)
            self.registry.save_run(tenant, model.record())
            return {"path": str(path), "type": "save_weights"}

        return self.submit(tenant, run, stream=model.model_id, seq=body.get("seq_id"), model_id=model.model_id)

    def _store(self, model: TrainingModel, path: TinkerPath, state: PolicyState, metadata) -> dict:
        files = {k: v for k, v in state.files.items() if k != "worker_rng.pt"}
        info = {"base_model": model.base_model, "lora_rank": model.lora_rank, "policy_version": state.policy_version,
                "user_metadata": metadata, **model.lora_flags}
        return self.registry.save(model.tenant, path, files, info)

    def save_weights_for_sampler(self, tenant: str, body: dict) -> dict:
        model = self.model(tenant, body["model_id"])
        name = body.get("path")
        if name is None and body.get("sampling_session_seq_id") is None:
            raise UserError("save_weights_for_sampler needs a path or a sampling_session_seq_id")

        def run() -> dict:
            state = self.worker.save_state(SaveStateRequest(model.policy, include_optimizer=False))
            if name is not None:
                path = TinkerPath(model.model_id, "sampler_weights", check_name(name))
                meta = self._store(model, path, state, body.get("user_metadata"))
                model.last_sampler_checkpoint = _public(meta)
                self.registry.save_run(tenant, model.record())
                return {"path": str(path), "type": "save_weights_for_sampler"}
            session = model.model_id.split(":train:")[0]
            sampler_id = f"{session}:sample:{int(body['sampling_session_seq_id'])}"
            self._add_sampler(Sampler(sampler_id, tenant, model.base_model, live=(model.model_id, state.policy_version), state=state))
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return self.submit(tenant, run, stream=model.model_id, seq=body.get("seq_id"), model_id=model.model_id)

    def _add_sampler(self, sampler: Sampler) -> None:
        with self._lock:
            self.samplers[sampler.sampler_id] = sampler
            if sampler.live is not None:
                kept = self._ephemeral.setdefault(sampler.live[0], [])
                kept.append(sampler.sampler_id)
                for old in kept[:-KEEP_EPHEMERAL]:  # bound memory: old RL-step snapshots go
                    self.samplers.pop(old, None)
                del kept[:-KEEP_EPHEMERAL]

    def load_weights(self, tenant: str, body: dict) -> dict:
        path = TinkerPath.parse(body["path"])
        if path.kind != "weights":
            raise UserError(
                f"{path} is a {path.kind} checkpoint: it holds no training state to load",
                hint="load a tinker://<run>/weights/<name> path from save_state; sampler weights are for sampling clients",
            )
        with_optimizer = bool(body.get("optimizer", False))
        if body.get("session_id") is not None:  # create-via-load: a new model whose id the SDK derives itself
            model = self._new_model(tenant, body["session_id"], body.get("model_seq_id", 0), body.get("base_model"),
                                    body.get("user_metadata"))
            fresh, seq = True, None
        else:
            model = self.model(tenant, body["model_id"])
            fresh, seq = False, body.get("seq_id")

        def run() -> dict:
            meta, files = self.registry.load(tenant, path)
            if fresh:
                model.lora_rank = int(meta.get("lora_rank") or 0)
                model.lora_flags = {k: meta[k] for k in ("train_attn", "train_mlp", "train_unembed") if k in meta}
                if model.user_metadata is None:
                    source = self.registry.load_run(tenant, path.run_id) or {}
                    model.user_metadata = source.get("user_metadata")
            state = PolicyState(model.policy, files, int(meta.get("policy_version", 0)))
            self.worker.load_state(LoadStateRequest(state, include_optimizer=with_optimizer))
            if fresh:
                self._register(model)
            return {"path": str(path), "model_id": model.model_id, "type": "load_weights"}

        return self.submit(tenant, run, stream=model.model_id, seq=seq, model_id=model.model_id)

    # -- sampling ------------------------------------------------------------------------

    def create_sampling_session(self, tenant: str, body: dict) -> dict:
        self.session(tenant, body["session_id"])
        sampler_id = f"{body['session_id']}:sample:{int(body['sampling_session_seq_id'])}"
        self._add_sampler(self._sampler_for(tenant, sampler_id, body.get("model_path"), body.get("base_model")))
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def _sampler_for(self, tenant: str, sampler_id: str, model_path: str | None, base_model: str | None) -> Sampler:
        if model_path is not None:
            path = TinkerPath.parse(model_path)
            meta = self.registry.info(tenant, path)  # fails now, clearly, if it does not exist
            from tinkerless.functions.models import public_model_id

            # Checkpoints written before Hub ids were advertised may name an alias: answer with the id.
            base = public_model_id(meta.get("base_model") or self.base_model)
            return Sampler(sampler_id, tenant, base, model_path=model_path)
        if base_model is None:
            raise UserError("sampling needs a model_path or a base_model")
        self._check_base_model(base_model)
        return Sampler(sampler_id, tenant, self.base_model)

    def get_sampler(self, tenant: str, sampler_id: str) -> dict:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.tenant != tenant:
            raise KeyError(sampler_id)
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def sample(self, tenant: str, body: dict) -> dict:
        if body.get("sampling_session_id") is not None:
            sampler = self.samplers.get(body["sampling_session_id"])
            if sampler is None or sampler.tenant != tenant:
                raise UserError(
                    f"unknown sampling session {body['sampling_session_id']!r}",
                    hint="sampling sessions of old RL steps expire; create a new sampling client",
                )
        else:
            sampler = self._sampler_for(tenant, "direct", body.get("model_path"), body.get("base_model"))
        unsupported = [k for k in ("topk_sample_logprobs",) if body.get(k)]
        if unsupported:
            raise UserError(f"sampling options {unsupported} are not supported by this server",
                            hint="see docs/tinker.md for the sampling options tinkerless implements")
        prompt = convert.model_input_tokens(convert.options(body, "prompt"))
        if not prompt:
            raise UserError("the prompt is empty", hint="send at least one token")
        num_samples = int(body.get("num_samples", 1))
        if not 1 <= num_samples <= 1024:
            raise UserError(f"num_samples={num_samples} is out of range (1-1024)")
        params = convert.options(body, "sampling_params")
        sampling, stop_strings = convert.sampling_params(params, self.worker)
        self.limits.check_sample(samples=num_samples, max_tokens=sampling.max_tokens, prompt_tokens=len(prompt))
        seed = params.get("seed")
        seed = int(seed) if seed is not None else secrets.randbelow(2**31)
        validate(SampleRequest("base", [prompt], num_samples, sampling, seed), vocab_size=self.worker.vocab_size)
        scoring = PromptScoring.parse(body, len(prompt), self.worker.vocab_size)
        ids = [f"seq-{next(self._sequence_ids)}-{secrets.token_hex(4)}" for _ in range(num_samples)]

        def run() -> Proto:
            policy = self._sampling_policy(sampler)
            # Pinned while it samples: the generation may pause between slices while other tenants'
            # samplers load snapshots, and must find its own adapter still there when it resumes.
            self._slots_in_use[policy] = self._slots_in_use.get(policy, 0) + 1
            try:
                generations = self.worker.engine.generate([prompt] * num_samples, sampling, policy=policy, seed=seed)
                scores = scoring.compute(self.worker, policy, prompt, sampling.temperature, seed) if scoring.needed else None
            finally:
                self._slots_in_use[policy] -= 1
                if not self._slots_in_use[policy]:
                    del self._slots_in_use[policy]
            sequences = [convert.apply_stop_strings(g, stop_strings, self.worker.tokenizer) for g in generations]
            return Proto(convert.sample_response(sequences, scores))

        return self.submit(tenant, run, sample_sequence_ids=ids)

    def _sampling_policy(self, sampler: Sampler) -> str:
        """The worker policy that holds this sampler's weights, loading a snapshot if needed (scheduler thread)."""
        if sampler.model_path is None and sampler.live is None:
            return BASE_POLICY
        if sampler.live is not None:
            model = self.models.get(sampler.live[0])
            if model is not None and self.worker.policies[model.policy].version == sampler.live[1]:
                return model.policy  # the training adapter has not moved since: no copy needed
            key, state = f"live:{sampler.sampler_id}", sampler.state
        else:
            key, state = f"path:{sampler.model_path}", None
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        if state is None:
            meta, files = self.registry.load(sampler.tenant, TinkerPath.parse(sampler.model_path))
            state = PolicyState("", files, int(meta.get("policy_version", 0)))
        slot = tenant_prefix(sampler.tenant) + "snap" + hashlib.sha256(key.encode()).hexdigest()[:16]
        files = {k: v for k, v in state.files.items() if k in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")}
        self.worker.load_state(LoadStateRequest(PolicyState(slot, files, state.policy_version), include_optimizer=False))
        self._slots[key] = slot
        evictable = [k for k, s in self._slots.items() if s not in self._slots_in_use and k != key]
        for old_key in evictable[: max(0, len(self._slots) - MAX_SNAPSHOT_SLOTS)]:  # least recently used first
            self.worker.delete_policy(self._slots.pop(old_key))
        return slot

    # -- runs and checkpoints ------------------------------------------------------------------

    def training_run(self, tenant: str, run_id: str) -> dict:
        model = self.models.get(run_id)
        if model is not None and model.tenant == tenant:
            return model.record()
        record = self.registry.load_run(tenant, run_id)
        if record is None:
            raise KeyError(run_id)
        return record

    def training_runs(self, tenant: str) -> list[dict]:
        stored = {r["training_run_id"]: r for r in self.registry.list_runs(tenant)}
        for model in list(self.models.values()):  # a copy: other threads register models
            if model.tenant == tenant:
                stored[model.model_id] = model.record()
        return sorted(stored.values(), key=lambda r: r.get("created_at", ""))

    def checkpoints(self, tenant: str, run_id: str) -> list[dict]:
        self.training_run(tenant, run_id)  # KeyError for someone else's or an unknown run
        return [_public(m) for m in self.registry.list(tenant, run_id)]

    def delete_checkpoint(self, tenant: str, run_id: str, kind: str, name: str) -> bool:
        return self.registry.delete(tenant, TinkerPath.parse(f"tinker://{run_id}/{kind}/{name}"))


def _public(meta: dict) -> dict:
    keys = ("checkpoint_id", "checkpoint_type", "time", "tinker_path", "size_bytes")
    return {**{k: meta[k] for k in keys}, "public": False, "user_metadata": meta.get("user_metadata"),
            "expires_at": meta.get("expires_at")}


def _loss_value(loss, data: list[Datum], logprobs: list[np.ndarray]) -> float:
    """The loss a forward_backward would report, for forward-only calls (no graph, no gradient)."""
    import torch

    from tinkerless.functions.losses import compute_loss

    total = 0.0
    for datum, lp in zip(data, logprobs):
        def row(x):
            return None if x is None else torch.as_tensor(np.asarray(x, np.float32))[None]

        value, _ = compute_loss(loss, row(lp), row(datum.mask), advantages=row(datum.advantages),
                                sampler_logprobs=row(datum.sampler_logprobs))
        total += float(value)
    return total
