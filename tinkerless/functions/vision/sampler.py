"""Sampling from a vision-language policy: image embeddings merged in the prefill, then a plain decode loop.

Every token is drawn by `device_sampling.draw_rows` (the text engine's own draw: the untempered log-prob recorded,
row i's uniform a hash of `row_seed(seed, i)` and its token position), so image episodes keep the text path's
guarantees.

- Rows of one prompt with no kept cache (a task's group) prefill once and decode together.
- A conversation that continues keeps its KV cache in a `VisionSession`: its next turn prefills only the tokens
  appended since (the observation, with its new images' features); the images of earlier turns are in the cache
  and are never encoded again.
The tower runs once per distinct image per call (`inputs.encode_images`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache

from tinkerless.errors import UserError
from tinkerless.functions.sampling.device_sampling import DrawSettings, draw_rows, row_keys
from tinkerless.functions.sampling.engine import Generation, row_seed
from tinkerless.functions.vision.inputs import (DEEPSTACK, attention_inputs, deepstack, encode_images, merged_embeddings,
                                               placeholder_ids, position_ids,
                                               without_placeholders)
from tinkerless.wire.content import VisionInput
from tinkerless.wire.messages import SamplingParams


@dataclass
class VisionSession:
    """A conversation's kept keys/values (of its first `length` tokens) between turns."""

    cache: Any = None
    length: int = 0
    weights: object = None

    def close(self) -> None:
        self.cache, self.length = None, 0


@dataclass
class VisionPrompt:
    tokens: list[int]
    images: list[VisionInput] = field(default_factory=list)  # every image of the conversation so far, in order


class VisionSampler:
    def __init__(self, get_model: Callable[[], Any], image_token_id: int, eos_token_ids: list[int],
                 activate: Callable[[str | None], Any], weights_tag: Callable[[str | None], object]):
        self.get_model, self.image_token_id = get_model, image_token_id
        self.eos_token_ids, self.activate, self.weights_tag = eos_token_ids, activate, weights_tag
        self.images_encoded = 0  # tower runs, for the stats and the test that each image is encoded once
        # One call at a time: an agent rollout's copies call from several threads, and the adapter switch and the
        # forwards of one call must not interleave with another's.
        self._lock = threading.Lock()

    def generate(self, prompts: list[VisionPrompt], sampling: SamplingParams, *, policy: str | None, seed: int,
                 sessions: list[VisionSession | None] | None = None) -> list[Generation]:
        if any(not p.tokens for p in prompts):
            raise UserError("a prompt to sample from is empty", hint="send at least one token per prompt")
        sessions = sessions or [None] * len(prompts)
        results: list[Generation | None] = [None] * len(prompts)
        with self._lock, torch.no_grad(), self.activate(policy):
            model = self.get_model()
            tag = self.weights_tag(policy)
            groups: dict[tuple, list[int]] = {}
            for i, (prompt, session) in enumerate(zip(prompts, sessions)):
                if session is not None:
                    groups[("row", i)] = [i]
                else:
                    key = (tuple(prompt.tokens), tuple(im.sha256 for im in prompt.images))
                    groups.setdefault(key, []).append(i)
            for rows in groups.values():
                for i, generation in zip(rows, self._group(model, prompts[rows[0]], rows, sampling, seed,
                                                           sessions[rows[0]] if len(rows) == 1 else None, tag)):
                    results[i] = generation
        return results  # type: ignore[return-value]

    def _group(self, model, prompt: VisionPrompt, rows: list[int], sampling: SamplingParams, seed: int,
               session: VisionSession | None, tag: object) -> list[Generation]:
        """Rows sharing one prompt: one prefill, the cache repeated per row, then decoding together."""
        device = next(model.parameters()).device
        tokens = prompt.tokens
        cached = 0
        cache = None
        if session is not None and session.cache is not None and session.weights == tag \
                and session.length < len(tokens):
            cache, cached = session.cache, session.length
        if session is not None:
            session.close()
        cache = cache if cache is not None else DynamicCache()
        new_ids = torch.tensor([tokens[cached:]], device=device)
        # Only the images whose tokens are in the new part: earlier ones are in the kept cache already.
        new_images = _images_after(tokens, prompt.images, cached, self.image_token_id)
        features = encode_images(model, new_images)
        self.images_encoded += sum(not key.endswith(DEEPSTACK) for key in features)
        embeds = merged_embeddings(model, new_ids, [new_images], features, self.image_token_id)
        full_positions = position_ids(model, torch.tensor([tokens], device=device), [prompt.images])
        positions = full_positions[:, :, cached:] if full_positions is not None else \
            torch.arange(cached, len(tokens), device=device)[None]
        with deepstack(model, new_ids, [new_images], features):
            out = model(inputs_embeds=embeds, position_ids=positions, past_key_values=cache, use_cache=True,
                        logits_to_keep=1, **attention_inputs(model, new_ids))
        banned = placeholder_ids(model)
        logits = without_placeholders(out.logits[:, -1].float(), banned)
        n = len(rows)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.expand(n, -1)
        # The text engine's draw: row r's uniform is a function of (its seed, its token position) only.
        settings = DrawSettings.of(row_keys([row_seed(seed, r) for r in rows]), [sampling] * n, logits.device)
        stop = set(self.eos_token_ids if sampling.stop_token_ids is None else sampling.stop_token_ids)
        drawn: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        reasons: list[str | None] = [None] * n
        last_position = (full_positions[:, 0, -1] if full_positions is not None else
                         torch.tensor([len(tokens) - 1], device=device))
        step = 0
        while step < sampling.max_tokens and any(r is None for r in reasons):
            picks, picked = draw_rows(logits, settings, torch.full((n,), step, dtype=torch.long, device=logits.device))
            picks_list, picked_list = picks.tolist(), picked.tolist()
            for b in range(n):
                if reasons[b] is not None:
                    continue
                drawn[b].append(picks_list[b])
                logprobs[b].append(picked_list[b])
                if picks_list[b] in stop:
                    reasons[b] = "stop"
                elif len(drawn[b]) >= sampling.max_tokens:
                    reasons[b] = "length"
            step += 1
            if all(r is not None for r in reasons):
                break
            # Finished rows ride along (their draws are not recorded): the batch keeps one shape.
            next_ids = picks[:, None].to(device)
            position = (last_position + step).view(-1, 1, 1).expand(-1, n, 1) if full_positions is not None else \
                (last_position + step).view(1, 1).expand(n, 1)
            logits = model(input_ids=next_ids, position_ids=position, past_key_values=cache, use_cache=True).logits[:, -1]
            logits = without_placeholders(logits.float(), banned)
        if session is not None and n == 1:
            covered = len(tokens) + len(drawn[0]) - 1  # the last drawn token was never fed back
            extra = cache.get_seq_length() - covered
            if extra > 0:
                cache.crop(-extra)
            session.cache, session.length, session.weights = cache, covered, tag
        return [Generation(drawn[b], logprobs[b], reasons[b] or "length", prefill_tokens=len(tokens) - cached,
                           cached_tokens=cached) for b in range(n)]


def _images_after(tokens: list[int], images: list[VisionInput], start: int, image_token_id: int) -> list[VisionInput]:
    """The images whose image tokens lie at or after `start` (images never straddle a turn boundary)."""
    before = sum(1 for t in tokens[:start] if t == image_token_id)
    skipped, out = 0, []
    for image in images:
        if skipped >= before:
            out.append(image)
        skipped += image.num_tokens
    return out
