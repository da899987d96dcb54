"""The worker: one base model in memory, one LoRA adapter + optimizer per policy.

It exposes the GPU functions (`rollout`, `forward`, `update`, plus the
Tinker-style primitives `sample`, `forward_backward`, `optim_step`,
`save_state`, `load_state`) as methods on wire types, and `handle()` which
takes and returns bytes: the single entry point every backend calls (the
local backend in-process, the HTTP server, Modal functions).

The adapters themselves (peft's model, adding, dropping and switching them) live in `policies`, and the
episode loops a rollout request runs in `rollout.requests`; the worker checks requests and calls them.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
import warnings
from typing import Any, Callable

import torch

from tinkerless.errors import ConfigError, ProtocolError, UserError
from tinkerless.functions.rollout import requests as rollout_requests
from tinkerless.functions.policies import Policy, PolicyAdapters
from tinkerless.functions.training import forward_backward as training, topk_distillation
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.functions.rollout.recording import check_sampled_versions
from tinkerless.functions.sampling.engine import TransformersEngine
from tinkerless.functions.training.policy_state import (ADAPTER_CONFIG, canonical_adapter_config, check_weights_fit,
                                                      parse_policy_state)
from tinkerless.functions.precision import dtype_name, resolve_dtype
from tinkerless.functions.models import resolve_model
from tinkerless.functions.vision.checks import check_images_fit, has_images
from tinkerless.functions.vision.runtime import attach_vision
from tinkerless.functions.threads import apply_threads, choose_threads
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.code import CodeBlob
from tinkerless.wire.replies import error_reply
from tinkerless.wire.validate import validate
from tinkerless.wire.messages import (
    BASE_POLICY, CreatePolicyRequest, ForwardBackwardRequest, ForwardBackwardResult, ForwardRequest, ForwardResult,
    LoadStateRequest, MultiAgentRolloutRequest, OptimStepRequest, OptimStepResult, PolicyState, ResetPolicyRequest,
    DeletePolicyRequest, RolloutRequest, RolloutResult, SampledSequence, SampleRequest, SampleResult,
    SaveStateRequest, UpdateRequest, UpdateResult
)

# transformers 5 warns about its own internal call when peft wraps a model; it is not actionable.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


_REQUEST_TYPES = {
    "create_policy": CreatePolicyRequest,
    "delete_policy": DeletePolicyRequest,
    "reset_policy": ResetPolicyRequest,
    "rollout": RolloutRequest,
    "rollout_multi": MultiAgentRolloutRequest,
    "sample": SampleRequest,
    "forward": ForwardRequest,
    "forward_backward": ForwardBackwardRequest,
    "optim_step": OptimStepRequest,
    "update": UpdateRequest,
    "save_state": SaveStateRequest,
    "load_state": LoadStateRequest,
}


class Worker:
    METHODS = ("info", *_REQUEST_TYPES)
    MODEL_FREE_METHODS = ("info",)  # read no model state: a server answers them without queueing
    # A rank of a sharded update (`functions/sharding`) runs its share of each batch: {"rank", "world_size", ...}.
    rank_args: dict[str, Any] = {}

    def __init__(
        self,
        model: str,
        *,
        device: str | None = None,
        engine: str = "auto",
        micro_batch_size: int = 16,
        max_batch_size: int = 64,
        threads: int | None = None,
        user_code_hosts: Any = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
    ):
        """`user_code_hosts` (a `tinkerless.functions.hosting.user_code.UserCodeHosts`): run the env/reward/agent code
        clients ship in each tenant's sandboxed process instead of unpickling it here (a shared server).
        `dtype`: the base weights' precision (`precision.py`: auto, bf16 or fp32; adapters stay fp32).
        `tensor_parallel_size`: the vLLM engine samples over that many GPUs (this copy, for adapters, stays on the CPU)."""
        from tinkerless.functions.memory_plan import load_device

        self.model_name = model
        # Before any torch work: the default thread count oversubscribes a loaded or restricted CPU.
        self.threads = choose_threads(threads)
        apply_threads(self.threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = resolve_dtype(dtype, self.device)
        self.tensor_parallel_size = tensor_parallel_size
        # Refuses a model this GPU cannot hold before loading it, naming the fix.
        where = load_device(model, self.device, dtype_name(self.dtype), engine, tensor_parallel_size)
        self.base_model, self.tokenizer = self._load_base_model(where)
        self.chat = ChatFormat(self.tokenizer, self.base_model.generation_config)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.micro_batch_size = micro_batch_size
        self.adapters = PolicyAdapters(self.base_model)
        # Called with a new policy's name before it is created; a server sets it to enforce a tenant's
        # policy quota (`ServingLimits.max_policies_per_tenant`), which it raises LimitExceeded to refuse.
        self.policy_guard: Callable[[str], None] | None = None
        self._code_cache: dict[str, Any] = {}
        self.user_code_hosts = user_code_hosts
        self.engine = self._make_engine(engine, max_batch_size)
        # A vision-language model's processor, chat with images and sampler (`functions/vision`); None for text.
        self.vision = attach_vision(self, getattr(self, "_image_processor", None))

    def _load_base_model(self, device: str) -> tuple[Any, Any]:
        """The base model and its tokenizer (a sharded update's rank loads only its share: `sharding.rank`)."""
        from tinkerless.functions.models import load_any_model

        model, tokenizer, self._image_processor = load_any_model(self.model_name, dtype=self.dtype, device=device)
        return model, tokenizer

    @property
    def model(self) -> Any:
        """The base model, then (from the first policy on) the PeftModel holding every policy's adapter."""
        return self.adapters.model

    @property
    def policies(self) -> dict[str, Policy]:
        return self.adapters.policies

    @property
    def vocab_size(self) -> int:
        """Token ids index the embedding; anything at or past its size is refused at the boundary."""
        return self.base_model.get_input_embeddings().num_embeddings

    @property
    def device_name(self) -> str:
        """"cpu", or the GPU's own name ("NVIDIA H100 80GB HBM3"): what pay-per-use accounting prices."""
        return torch.cuda.get_device_name(torch.device(self.device)) if self.device.startswith("cuda") else self.device

    def _make_engine(self, engine: str, max_batch_size: int):
        """transformers everywhere; vLLM (sampling from hot-loaded LoRA adapters) when it and a GPU are present."""
        from tinkerless.functions.memory_plan import vllm_parallel
        from tinkerless.functions.sampling.vllm_engine import VLLMEngine, vllm_available

        if engine not in ("auto", "transformers", "vllm"):
            raise ConfigError(f"unknown engine {engine!r}", hint="engine='auto', 'transformers' or 'vllm'")
        if engine == "vllm" or (engine == "auto" and vllm_available()):
            parallel = vllm_parallel(self.tensor_parallel_size)
            return VLLMEngine(resolve_model(self.model_name), self._adapter_snapshot, expected_probe=self._probe, **parallel)
        return TransformersEngine(
            self.base_model, self.tokenizer, self.chat.eos_token_ids, self._activate, max_batch_size=max_batch_size,
            adapter_of=self.adapters.adapter_name,
        )

    def _probe(self, policy: str) -> tuple[list[int], list[float]]:
        """The hand-off's probe tokens and this worker's log-probs of them under `policy` as it is now."""
        from tinkerless.functions import handoff

        return handoff.probe(self, policy)

    def _adapter_snapshot(self, policy: str) -> tuple[str, str] | None:
        """The policy's current adapter as a PEFT directory (written once per version) for the vLLM engine."""
        return self.adapters.snapshot(
            policy, lambda name: self.save_state(SaveStateRequest(name, include_optimizer=False)).files
        )

    # ---- bytes in, bytes out -------------------------------------------------
    def handle(self, method: str, payload: bytes) -> bytes:
        """Run one function call from its encoded request; errors come back as an `ErrorReply`."""
        try:
            if method not in self.METHODS:
                raise UserError(f"unknown function {method!r}", hint=f"one of {', '.join(self.METHODS)}")
            request = decode_message(payload)
            expected = _REQUEST_TYPES.get(method)
            if expected is not None and not isinstance(request, expected):
                raise ProtocolError(
                    f"{method} expects a {expected.__name__}, got {type(request).__name__}",
                    hint="send the request type from tinkerless.wire.messages (client and server versions must match)",
                )
            if expected is not None:  # every value from the caller, before it reaches the model
                validate(request, vocab_size=self.vocab_size)
                check_images_fit(self, request)  # processed images only for a VLM, and as its processor gives
            return encode_message(getattr(self, method)(request))
        except Exception as exc:  # every failure becomes a structured reply, never a dropped connection
            return encode_message(error_reply(exc))

    # ---- policies ------------------------------------------------------------
    def info(self, _request: Any = None) -> dict:
        return {
            "model": self.model_name,
            "device": self.device,
            "device_name": self.device_name,
            "dtype": dtype_name(self.dtype),
            "engine": self.engine.name,
            "threads": self.threads.threads,
            # A copy first: a server answers info while another thread may be creating a policy.
            "policies": {name: p.version for name, p in self.policies.copy().items()},
        }

    def create_policy(self, request: CreatePolicyRequest) -> dict:
        name = request.policy
        if name in self.policies:
            return {"policy": name, "created": False}
        validate(request)  # direct callers too (the Tinker API, load_state), not only handle()
        if name == BASE_POLICY or name in "lora_":
            # peft finds adapter weights by substring; a name inside "lora_" would corrupt loading.
            raise ConfigError(f"invalid policy name {name!r}", hint="use 2+ letters, digits, '-' and '_' (not 'base')")
        if self.policy_guard is not None:
            self.policy_guard(name)
        self.adapters.add(name, request.lora, on_wrap=self._engine_samples_from)
        return {"policy": name, "created": True}

    def _engine_samples_from(self, model: Any) -> None:
        # The transformers engine holds the model object: the PeftModel the first policy wraps replaces the base.
        if isinstance(self.engine, TransformersEngine):
            self.engine.model = model

    def reset_policy(self, request: ResetPolicyRequest) -> dict:
        """Re-initialize an existing policy exactly as `create_policy` made it from its LoRA seed:
        the adapter's init, a fresh optimizer, version 0 (see `policy_state.reinit_adapter`)."""
        name = request.policy
        if request.missing_ok and name not in self.policies:
            return {"policy": name, "policy_version": 0}
        self.adapters.reset(name)
        return {"policy": name, "policy_version": 0}

    def delete_policy(self, request: DeletePolicyRequest) -> dict:
        """A client freeing one of its policies (its checkpoints stay). Refused while a generation of it runs."""
        name = request.policy
        batcher = getattr(self.engine, "batcher", None)
        if batcher is not None and name in batcher.policies_in_use():
            raise UserError(f"policy {name!r} is sampling right now", hint="delete it once its calls have finished")
        return {"policy": name, "deleted": self.drop_policy(name)}

    def drop_policy(self, name: str) -> bool:
        """Free a policy's adapter and optimizer (a server evicting sampler snapshots). False if absent."""
        return self.adapters.drop(name)

    # The adapters' own methods under the names the server, the engines and tests use.
    def _policy(self, name: str) -> Policy:
        return self.adapters.get(name)

    def _activate(self, policy: str | None):
        """A context manager: the block runs with `policy`'s adapter (see `PolicyAdapters.activate`)."""
        return self.adapters.activate(policy)

    def _forget_snapshots(self, name: str) -> None:
        self.adapters.forget_snapshots(name)

    # ---- rollout ---------------------------------------------------------------
    def _load_code(self, blob: CodeBlob | None) -> Any:
        return rollout_requests.load_code(blob, self.user_code_hosts, self._code_cache)

    def rollout(self, request: RolloutRequest) -> RolloutResult:
        if self.vision is not None and request.agent is None:
            if request.policy != BASE_POLICY:
                self._policy(request.policy)
            with self._hosted_code():
                return self.vision.rollout(request, self._load_code)
        if self.vision is None and has_images(request.tasks):
            raise UserError(f"model {self.model_name!r} takes no images: a task of this rollout holds one",
                            hint="use a vision-language model (docs/vision.md), or send text only")
        with self._hosted_code():
            return rollout_requests.rollout(
                request, engine=self.engine, chat=self.chat, tokenizer=self.tokenizer, hosts=self.user_code_hosts,
                code_cache=self._code_cache, check_policy=self._policy, vision=self.vision, judge=self._judge,
            )

    def _judge(self, episodes: list, spec: Any) -> dict:  # an LLM judge beside the rollout (companions/judge.py)
        from tinkerless.functions.companions.judge_engine import judge_on_worker
        return judge_on_worker(self, episodes, spec)

    def _next_token_logprobs(self, prompts: list[list[int]]) -> Any:  # a judge's verdict distribution
        from tinkerless.functions.companions.judge_engine import next_token_logprobs
        return next_token_logprobs(self, prompts)

    def rollout_multi(self, request: MultiAgentRolloutRequest) -> RolloutResult:
        """Play multi-agent games; one episode per game and model-played role."""
        with self._hosted_code():
            return rollout_requests.rollout_multi(
                request, engine=self.engine, chat=self.chat, hosts=self.user_code_hosts, code_cache=self._code_cache,
                check_policy=self._policy,
            )

    @contextlib.contextmanager
    def _hosted_code(self):
        try:
            yield
        finally:  # the envs of this rollout are done: the tenant's host may forget them
            if self.user_code_hosts is not None:
                self.user_code_hosts.release()

    def sample(self, request: SampleRequest) -> SampleResult:
        token_prompts = [
            self.chat.prompt_tokens([{"role": "user", "content": p}]) if isinstance(p, str) else list(p)
            for p in request.prompts
        ]
        prompts = [p for p in token_prompts for _ in range(request.num_samples)]
        generations = self.engine.generate(prompts, request.sampling, policy=request.policy, seed=request.seed)
        out: list[list[SampledSequence]] = []
        for i in range(len(request.prompts)):
            group = generations[i * request.num_samples : (i + 1) * request.num_samples]
            out.append(
                [
                    SampledSequence(g.tokens, g.logprobs, self.tokenizer.decode(g.tokens, skip_special_tokens=True), g.stop_reason)
                    for g in group
                ]
            )
        return SampleResult(out)

    # ---- forward / update ------------------------------------------------------
    def forward(self, request: ForwardRequest) -> ForwardResult:
        with self._activate(request.policy):
            if request.topk and not self.rank_args and not any(d.images for d in request.data):
                # a teacher's top k: one pass gives the tokens' log-probs and the top-k rows alike
                logprobs, *topk = topk_distillation.teacher_topk(self.model, request.data, request.topk)
            else:
                logprobs = training.forward(self.model, request.data, self.pad_id, self.micro_batch_size, **self.rank_args)
                topk = topk_distillation.teacher_topk(self.model, request.data, request.topk)[1:] if request.topk else (None, None)
        ref = None
        if request.with_reference:
            with self._activate(BASE_POLICY):
                ref = training.forward(self.model, request.data, self.pad_id, self.micro_batch_size, **self.rank_args)
        return ForwardResult(logprobs, ref, *topk)

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        if not request.data:
            raise UserError("forward_backward got an empty batch", hint="send at least one datum")
        if request.loss.name == "topk_forward_kl":  # a teacher's top-k distributions as targets
            if self.rank_args:
                raise UserError("topk_forward_kl runs on one process", hint="train it without --gpus")
            with self._activate(request.policy):
                metrics = topk_distillation.topk_backward(self.model, request.data, self.micro_batch_size, self.pad_id)
                return ForwardBackwardResult(metrics, [])
        with self._activate(request.policy):
            metrics, logprobs = training.forward_backward(
                self.model, request.data, request.loss, self.pad_id, self.micro_batch_size, **self.rank_args
            )
        return ForwardBackwardResult(metrics, logprobs)

    def optim_step(self, request: OptimStepRequest) -> OptimStepResult:
        policy = self._policy(request.policy)
        adam = request.adam
        for group in policy.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay)
        grads = [p.grad for p in policy.params if p.grad is not None]
        grad_norm = training.gradient_norm(grads) if grads else 0.0
        # A NaN or inf gradient would make every weight NaN and every later sample garbage: the step is skipped
        # (as a loss scaler skips it), the version still counts, and the metrics say so.
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            if adam.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(policy.params, adam.grad_clip_norm)
            policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
        policy.version += 1
        metrics = {"learning_rate": adam.learning_rate, "optim_step_skipped": float(skipped)}
        if not skipped:  # metrics travel as JSON too (Tinker, metrics.jsonl), which has no inf or NaN
            metrics["grad_norm"] = grad_norm
        return OptimStepResult(metrics, policy.version)

    def update(self, request: UpdateRequest) -> UpdateResult:
        # Every trained token was sampled within the staleness bound of this policy's version (recording.py).
        check_sampled_versions(self._policy(request.policy).version, request.data, getattr(request, "max_staleness", None))
        fb = self.forward_backward(ForwardBackwardRequest(request.policy, request.data, request.loss))
        step = self.optim_step(OptimStepRequest(request.policy, request.adam))
        return UpdateResult({**fb.metrics, **step.metrics}, step.policy_version)

    # ---- state -----------------------------------------------------------------
    def save_state(self, request: SaveStateRequest) -> PolicyState:
        """The adapter in standard PEFT format (loadable by `PeftModel.from_pretrained`), optimizer and RNG."""
        policy = self._policy(request.policy)
        files: dict[str, bytes] = {}
        with tempfile.TemporaryDirectory() as tmp:
            # save_embedding_layers=False: a LoRA on a tied lm_head must not drag the frozen embedding
            # matrix (113 MB on SmolLM2) into every adapter file; only the LoRA weights change.
            weights = self._adapter_weights(request.policy)
            self.model.save_pretrained(tmp, selected_adapters=[request.policy], save_embedding_layers=False,
                                       **({} if weights is None else {"state_dict": weights}))
            # PEFT writes the adapter named "default" at the root and any other name in a subfolder.
            root = tmp if request.policy == "default" else os.path.join(tmp, request.policy)
            for name in sorted(os.listdir(root)):
                path = os.path.join(root, name)
                if os.path.isfile(path):
                    with open(path, "rb") as f:
                        files[f"adapter/{name}"] = f.read()
        files[ADAPTER_CONFIG] = canonical_adapter_config(files[ADAPTER_CONFIG])
        if request.include_optimizer:
            buffer = io.BytesIO()
            torch.save(self._optimizer_state(policy), buffer)
            files["optimizer.pt"] = buffer.getvalue()
        buffer = io.BytesIO()
        torch.save({"torch": torch.get_rng_state(), "version": policy.version}, buffer)
        files["worker_rng.pt"] = buffer.getvalue()
        return PolicyState(request.policy, files, policy.version)

    def load_state(self, request: LoadStateRequest) -> dict:
        from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

        state = request.state
        parsed = parse_policy_state(state.policy, state.files, request.include_optimizer)
        created = state.policy not in self.policies
        if created:
            self.create_policy(CreatePolicyRequest(state.policy, parsed.lora))
        policy = self.policies[state.policy]
        try:
            # Every check before the first change: a bad state leaves the policy as it was.
            expected = get_peft_model_state_dict(self.model, adapter_name=state.policy, save_embedding_layers=False)
            check_weights_fit(state.policy, parsed.weights, expected)
            optimizer = torch.optim.AdamW(policy.params, lr=1e-4)
            if parsed.optimizer is not None:
                try:
                    optimizer.load_state_dict(self._optimizer_state_to_load(policy, parsed.optimizer))
                except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                    raise UserError(
                        f"policy state for {state.policy!r}: optimizer.pt does not fit this adapter ({exc})",
                        hint="load the optimizer state saved with this adapter, or load without the optimizer",
                    ) from None
        except BaseException:
            if created:
                self.drop_policy(state.policy)
            raise
        set_peft_model_state_dict(self.model, self._weights_to_load(parsed.weights), adapter_name=state.policy)
        # The loaded state replaces the policy's whole training state: moments from before the load
        # belong to other weights, so the optimizer starts fresh unless the state carries its own.
        policy.optimizer = optimizer
        for p in policy.params:
            p.grad = None
        if parsed.rng is not None:
            torch.set_rng_state(parsed.rng)
        policy.version = state.policy_version
        self._forget_snapshots(state.policy)
        return {"policy": state.policy, "policy_version": policy.version}

    # What a sharded rank (`functions/sharding/rank.py`) replaces: full tensors out, its shards in.
    def _adapter_weights(self, name: str) -> dict[str, torch.Tensor] | None:
        return None  # peft reads them off the model

    def _optimizer_state(self, policy: Policy) -> dict:
        return policy.optimizer.state_dict()

    def _weights_to_load(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return weights

    def _optimizer_state_to_load(self, policy: Policy, state: dict) -> dict:
        return state
