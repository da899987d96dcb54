"""The Tinker service's training calls: create a LoRA training model, forward(_backward), optim_step,
save and load its weights.

Each call is validated, then queued as a job on the shared scheduler in the training model's
stream (ordered by the SDK's `seq_id`). Checks that need the model's turn run inside the job, so a
refused call still uses up its place in the order.
"""

from __future__ import annotations

import hashlib
import secrets
import time

import numpy as np

from tinkerless.errors import UserError
from tinkerless.server.limits import LimitExceeded
from tinkerless.server.tenancy import tenant_prefix
from tinkerless.server.tinker_api import convert
from tinkerless.server.tinker_api.checkpoints import TinkerPath, check_name
from tinkerless.server.tinker_api.records import Proto, Sampler, TrainingModel, public_checkpoint
from tinkerless.wire.messages import (
    AdamParams,
    CreatePolicyRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    LoraConfig,
    OptimStepRequest,
    PolicyState,
    SaveStateRequest,
)
from tinkerless.wire.validate import validate


STALE_SESSION_SECONDS = 120.0  # twelve missed heartbeats of the Tinker SDK (one every 10 s)


class TrainingCalls:
    """The training half of `TinkerService` (which provides session, model, submit, registry, worker, _add_sampler)."""

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
            request = CreatePolicyRequest(model.policy, config)
            try:
                self.worker.create_policy(request)
            except LimitExceeded:  # the tenant's policy quota: models of its sessions that went silent make room
                if not self._free_stale_models(tenant):
                    raise
                self.worker.create_policy(request)
            self._register(model)
            return {"model_id": model.model_id, "type": "create_model"}

        return self.submit(tenant, run, model_id=model.model_id)

    def _free_stale_models(self, tenant: str) -> int:
        """Free the tenant's training models whose session sent no heartbeat for STALE_SESSION_SECONDS (the
        Tinker SDK has no call to free a model: a client that is gone stops heartbeating). Their saved
        checkpoints stay. Runs in the scheduler's job, so no call of theirs is running. Returns how many."""
        cutoff = time.monotonic() - STALE_SESSION_SECONDS
        with self._lock:
            stale = [m for m in self.models.values() if m.tenant == tenant
                     and self.sessions.get(m.model_id.split(":train:")[0], {}).get("seen", 0.0) < cutoff]
            for model in stale:
                del self.models[model.model_id]
                self.freed_models[model.model_id] = tenant
        for model in stale:
            self.worker.drop_policy(model.policy)
        return len(stale)

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
        vision = self.worker.vision.processor if getattr(self.worker, "vision", None) is not None else None
        model_id, seq_id, loss_fn, config, forward_only, raw = convert.parse_forward_backward(body)
        model = self.model(tenant, model_id)

        def run() -> Proto:  # checked in here: a refused call must still use up its place in the model's order
            loss = convert.loss_config(loss_fn, config)
            resolved = convert.with_images(raw, vision)  # image chunks checked and processed here, in the call's place
            data = [convert.to_datum(i, tokens, inputs, loss_fn) for i, (tokens, inputs, _) in enumerate(resolved)]
            for datum, (_, _, images) in zip(data, resolved):  # the processed images, in token order
                datum.images = images or None
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
            return {"metrics": {"grad_norm:mean": result.metrics.get("grad_norm", 0.0), "learning_rate:mean": adam.learning_rate}}

        return self.submit(tenant, run, stream=model.model_id, seq=body.get("seq_id"), model_id=model.model_id)

    def save_weights(self, tenant: str, body: dict) -> dict:
        model = self.model(tenant, body["model_id"])
        path = TinkerPath(model.model_id, "weights", check_name(body["path"]))

        def run() -> dict:
            state = self.worker.save_state(SaveStateRequest(model.policy, include_optimizer=True))
            meta = self._store(model, path, state, body.get("user_metadata"))
            model.last_checkpoint = public_checkpoint(meta)
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
                model.last_sampler_checkpoint = public_checkpoint(meta)
                self.registry.save_run(tenant, model.record())
                return {"path": str(path), "type": "save_weights_for_sampler"}
            session = model.model_id.split(":train:")[0]
            sampler_id = f"{session}:sample:{int(body['sampling_session_seq_id'])}"
            self._add_sampler(Sampler(sampler_id, tenant, model.base_model, live=(model.model_id, state.policy_version), state=state))
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return self.submit(tenant, run, stream=model.model_id, seq=body.get("seq_id"), model_id=model.model_id)

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
