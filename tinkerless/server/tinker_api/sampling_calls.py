"""The Tinker service's sampling calls: sampling sessions, `asample`, and the adapters samplers read.

A sampler samples from the base model, from a saved `sampler_weights/` checkpoint, or from a
snapshot of a live training model taken by `save_weights_for_sampler`. Snapshots and
checkpoints are loaded as adapters on the worker, a few at a time (least recently used go first);
a sample in progress pins its adapter. Every sample call is an unordered job on the shared
scheduler, so concurrent calls decode in one batch (`tinkerless.functions.sampling.batcher`).
"""

from __future__ import annotations

import hashlib
import secrets

from tinkerless.errors import UserError
from tinkerless.server.budgets import served_model
from tinkerless.server.tinker_api import convert
from tinkerless.server.tinker_api.checkpoints import TinkerPath
from tinkerless.server.tinker_api.prompt_scores import PromptScoring
from tinkerless.server.tinker_api.records import Proto, Sampler
from tinkerless.wire.messages import BASE_POLICY, LoadStateRequest, PolicyState, SampleRequest
from tinkerless.wire.validate import validate

MAX_SNAPSHOT_SLOTS = 4  # sampler snapshots kept loaded as adapters on the worker
KEEP_EPHEMERAL = 8  # ephemeral sampler weights kept per training model


class SamplingCalls:
    """The sampling half of `TinkerService` (which provides session, models, submit, registry, worker, limits)."""

    def _add_sampler(self, sampler: Sampler) -> None:
        with self._lock:
            self.samplers[sampler.sampler_id] = sampler
            if sampler.live is not None:
                kept = self._ephemeral.setdefault(sampler.live[0], [])
                kept.append(sampler.sampler_id)
                for old in kept[:-KEEP_EPHEMERAL]:  # bound memory: old RL-step snapshots go
                    self.samplers.pop(old, None)
                del kept[:-KEEP_EPHEMERAL]

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
        if base_model in self.extra_workers:  # one of the server's extra models: its base weights
            return Sampler(sampler_id, tenant, self.extra_workers[base_model][0])
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
        worker, extra = self._worker_for(sampler)
        served_model.set(extra)  # the key's usage counts an extra model's seconds under its id
        unsupported = [k for k in ("topk_sample_logprobs",) if body.get(k)]
        if unsupported:
            raise UserError(f"sampling options {unsupported} are not supported by this server",
                            hint="see docs/tinker.md for the sampling options tinkerless implements")
        vision = worker.vision if getattr(worker, "vision", None) is not None else None
        prompt, images = convert.model_input_with_images(convert.options(body, "prompt"),
                                                         vision.processor if vision is not None else None)
        if not prompt:
            raise UserError("the prompt is empty", hint="send at least one token")
        num_samples = int(body.get("num_samples", 1))
        if not 1 <= num_samples <= 1024:
            raise UserError(f"num_samples={num_samples} is out of range (1-1024)")
        params = convert.options(body, "sampling_params")
        sampling, stop_strings = convert.sampling_params(params, worker)
        self.limits.check_sample(samples=num_samples, max_tokens=sampling.max_tokens, prompt_tokens=len(prompt))
        seed = params.get("seed")
        seed = int(seed) if seed is not None else secrets.randbelow(2**31)
        validate(SampleRequest("base", [prompt], num_samples, sampling, seed), vocab_size=worker.vocab_size)
        scoring = PromptScoring.parse(body, len(prompt), worker.vocab_size)
        if images and scoring.needed:
            raise UserError("prompt log-probs of a prompt with images are not supported yet",
                            hint="sample without prompt_logprobs, or send the prompt without images")
        ids = [f"seq-{next(self._sequence_ids)}-{secrets.token_hex(4)}" for _ in range(num_samples)]

        def run() -> Proto:
            policy = self._sampling_policy(sampler)
            # Pinned while it samples: the generation may pause between slices while other tenants'
            # samplers load snapshots, and must find its own adapter still there when it resumes.
            self._slots_in_use[policy] = self._slots_in_use.get(policy, 0) + 1
            try:
                if images:  # image features merged in the prefill (functions/vision/sampler.py)
                    from tinkerless.functions.vision.sampler import VisionPrompt

                    generations = vision.sampler.generate([VisionPrompt(prompt, images)] * num_samples, sampling,
                                                          policy=policy, seed=seed)
                else:
                    generations = worker.engine.generate([prompt] * num_samples, sampling, policy=policy, seed=seed)
                scores = scoring.compute(worker, policy, prompt, sampling.temperature, seed) if scoring.needed else None
            finally:
                self._slots_in_use[policy] -= 1
                if not self._slots_in_use[policy]:
                    del self._slots_in_use[policy]
            sequences = [convert.apply_stop_strings(g, stop_strings, worker.tokenizer) for g in generations]
            return Proto(convert.sample_response(sequences, scores))

        return self.submit(tenant, run, sample_sequence_ids=ids)

    def _worker_for(self, sampler: Sampler) -> tuple[object, str | None]:
        """(the worker a sampler samples on, the extra model's id or None for the main model)."""
        found = self.extra_workers.get(sampler.base_model) if sampler.model_path is None and sampler.live is None else None
        return (found[1], found[0]) if found is not None else (self.worker, None)

    def _sampling_policy(self, sampler: Sampler) -> str:
        """The worker policy that holds this sampler's weights, loading a snapshot if needed (scheduler thread)."""
        if sampler.model_path is None and sampler.live is None:
            return BASE_POLICY
        if sampler.live is not None:
            model = self.models.get(sampler.live[0])
            if model is not None and self.worker.policies[model.policy].version == sampler.live[1]:
                return model.policy  # the training adapter has not moved since: no copy needed
            key, state = f"live:{sampler.tenant}:{sampler.sampler_id}", sampler.state
        else:  # keyed by tenant too: the same path string of two tenants names two checkpoints
            key, state = f"path:{sampler.tenant}:{sampler.model_path}", None
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        if state is None:
            meta, files = self.registry.load(sampler.tenant, TinkerPath.parse(sampler.model_path))
            state = PolicyState("", files, int(meta.get("policy_version", 0)))
        # A server-owned slot (outside the tenant's policy names, so it is not in its listing or its policy
        # quota): at most MAX_SNAPSHOT_SLOTS exist, evicted least recently used first.
        slot = "tinker_snap_" + hashlib.sha256(key.encode()).hexdigest()[:16]
        files = {k: v for k, v in state.files.items() if k in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")}
        self.worker.load_state(LoadStateRequest(PolicyState(slot, files, state.policy_version), include_optimizer=False))
        self._slots[key] = slot
        evictable = [k for k, s in self._slots.items() if s not in self._slots_in_use and k != key]
        for old_key in evictable[: max(0, len(self._slots) - MAX_SNAPSHOT_SLOTS)]:  # least recently used first
            self.worker.drop_policy(self._slots.pop(old_key))
        return slot
