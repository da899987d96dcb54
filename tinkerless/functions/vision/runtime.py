"""What a worker holds for a vision-language model: its processor, chat with images, and sampler."""

from __future__ import annotations

import time
from typing import Any

from tinkerless.functions.rollout.agent_loop import TokenCounts
from tinkerless.functions.rollout.rollout_clock import rollout_clock
from tinkerless.functions.vision.episodes import run_vision_episodes
from tinkerless.functions.vision.processing import VisionChat, VisionProcessor
from tinkerless.functions.vision.sampler import VisionSampler
from tinkerless.wire.messages import RolloutRequest, RolloutResult


class VisionRuntime:
    def __init__(self, worker: Any, image_processor: Any):
        self.worker = worker
        self.processor = VisionProcessor(worker.base_model.config, image_processor)
        self.chat = VisionChat(worker.chat, self.processor)
        self.sampler = VisionSampler(lambda: worker.model, self.processor.image_token_id, worker.chat.eos_token_ids,
                                     worker._activate, self._weights_tag)

    def _weights_tag(self, policy: str | None) -> object:
        engine = self.worker.engine
        return engine.weights_tag(policy) if hasattr(engine, "weights_tag") else (policy, time.monotonic())

    def rollout(self, request: RolloutRequest, load_code: Any) -> RolloutResult:
        started = time.perf_counter()
        with rollout_clock() as clock:
            episodes = run_vision_episodes(
                self.sampler, self.chat, policy=request.policy, tasks=request.tasks, group_size=request.group_size,
                sampling=request.sampling, limits=request.limits, seed=request.seed,
                env_cls=load_code(request.env), reward_fn=load_code(request.reward),
                system_prompt=request.system_prompt, counts=(counts := TokenCounts()))
        sampled = float(sum(e.sampled_tokens() for e in episodes))
        images = float(sum(len(e.images) for e in episodes))
        return RolloutResult(episodes, {"sampled_tokens": sampled, "seconds": time.perf_counter() - started,
                                        "images": images, **counts.as_stats(), **clock.as_stats()})


def attach_vision(worker: Any, image_processor: Any) -> VisionRuntime | None:
    """The worker's vision runtime when its model came with an image processor (None for a text model); LoRA then
    targets the language model's layers (and the connector or tower when a policy's config asks)."""
    if image_processor is None:
        return None
    from tinkerless.functions.vision.models import lora_targets

    worker.adapters.resolve_lora = lambda lora: lora_targets(worker.base_model, lora)
    return VisionRuntime(worker, image_processor)
