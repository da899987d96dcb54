"""The LLM judge on the policy's own worker: its prompts in token space, its forward, its verdicts.

`judge.py` holds what every judge shares (prompts as text, verdicts, the cache, failures); this module runs a
judge on the engine: the graded text tokenized with special tokens split, the step's questions read with their
common beginnings computed once (KV-cache prefixes), the verdict read from the next-token distribution over
the ten digits after `Score: `.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tinkerless.errors import InfrastructureFailure
from tinkerless.functions.companions.judge import (PREFILL, JudgePrompt, Verdict, VerdictCache, judge_episodes,
                                                   mark_failed, same_model)
from tinkerless.wire.messages import JudgeSpec


def digit_ids(tokenizer: Any) -> list[int]:
    ids = [tokenizer.encode(str(d), add_special_tokens=False) for d in range(10)]
    if any(len(i) != 1 for i in ids):
        raise InfrastructureFailure(
            "the judge model's tokenizer spells some digit 0-9 in more than one token, so its verdict cannot be "
            "read from one next-token distribution", cause="judge_failed",
            hint="use another judge model, or an OpenAI-compatible endpoint (tinkerless.judge(..., endpoint=...))")
    return [i[0] for i in ids]


def prompt_tokens(prompt: JudgePrompt, tokenizer: Any, render: Callable[[list[dict]], str]) -> list[int]:
    """The judge's prompt in token space: the template's frame and the instructions encoded as usual, every
    graded text with special tokens split into plain characters (it cannot open or close a message)."""
    placeholder = "\u2063GRADED\u2063"
    user = prompt.user_before + placeholder + prompt.user_after
    text = render([{"role": "system", "content": prompt.system}, {"role": "user", "content": user}]) + PREFILL
    before, _, after = text.partition(placeholder)

    def encode(part: str, *, plain: bool = False) -> list[int]:
        return list(tokenizer(part, add_special_tokens=False, split_special_tokens=plain)["input_ids"])

    ids = encode(before)
    for n, (opening, graded, closing) in enumerate(prompt.graded):
        ids += encode(("\n" if n else "") + opening + "\n") + encode(graded, plain=True) + encode("\n" + closing)
    return ids + encode(after)


def engine_verdicts(next_token_logprobs: np.ndarray, digits: list[int]) -> list[Verdict]:
    """Verdicts from the judge's log-probs of its next token ([n, vocab]) after `Score: `."""
    out = []
    for row in np.asarray(next_token_logprobs, dtype=np.float64):
        picked = row[digits]
        mass = np.exp(picked - picked.max())
        probs = mass / mass.sum()
        out.append(Verdict(score=float((probs * np.arange(10)).sum() / 9.0), digit=int(np.argmax(picked)),
                           format_mass=float(np.exp(picked).sum())))
    return out


def judge_on_worker(worker: Any, episodes: list[Any], spec: JudgeSpec) -> dict:
    """`judge_episodes` on a worker: its base model (adapters off) as the judge, or an endpoint; its cache."""
    from tinkerless.errors import UserError

    if spec.endpoint is None and spec.model is not None and not same_model(spec.model, worker.model_name):
        raise UserError(
            f"judge model {spec.model!r} is not this worker's model {worker.model_name!r}",
            hint="leave model= out to judge with the policy's base model on this worker, or serve the judge "
            "elsewhere and pass endpoint='http://host:port/v1' (with model= its name there)",
        )
    if spec.endpoint is not None and worker.user_code_hosts is not None:
        raise UserError("a shared server calls no tenant's endpoint", hint="judge on the server's own model "
                        "(leave endpoint= out), or run the judge from your client")
    if getattr(worker, "judge_cache", None) is None:
        worker.judge_cache = VerdictCache()
    stats = judge_episodes(
        episodes, spec, judge_model=spec.model or (spec.endpoint or worker.model_name), cache=worker.judge_cache,
        score_tokens=None if spec.endpoint else worker._next_token_logprobs, tokenizer=worker.tokenizer,
        render=worker.chat.render, fail=mark_failed,
    )
    return stats.as_stats()


def next_token_logprobs(worker: Any, prompts: list[list[int]]) -> np.ndarray:
    """The worker's base model's log-probs of the token after each prompt ([n, vocab]): the judge's verdict
    distribution. What the prompts share runs once: their common beginning (the instructions and rubric) as one
    KV cache, then, for each batch of prompts about the same task (consecutive in sorted order), the task's part
    on top of it; each prompt's own rest (the graded text) runs right-padded in that batch (a causal model never
    lets a real token see a pad)."""
    import torch

    from tinkerless.wire.messages import BASE_POLICY

    shared = _common_prefix(prompts)
    order = sorted(range(len(prompts)), key=lambda n: prompts[n])
    out: dict[int, np.ndarray] = {}
    with torch.no_grad(), worker._activate(BASE_POLICY):
        root = _prefill(worker, prompts[0][:shared], None) if shared else None
        for batch in _batches([prompts[n] for n in order], shared, worker.micro_batch_size):
            rows = [order[n] for n in batch]
            common = _common_prefix([prompts[n] for n in rows])
            cache = _prefill(worker, prompts[rows[0]][shared:common], root)
            cache.batch_repeat_interleave(len(rows))
            rest = [prompts[n][common:] for n in rows]
            ids = torch.full((len(rows), max(len(p) for p in rest)), worker.pad_id, dtype=torch.long)
            for row, tokens in enumerate(rest):
                ids[row, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            lasts = sorted({len(p) - 1 for p in rest})
            logits = worker.model(input_ids=ids.to(worker.device), past_key_values=cache, use_cache=True,
                                  logits_to_keep=torch.as_tensor(lasts, device=worker.device)).logits
            for row, n in enumerate(rows):
                picked = logits[row, lasts.index(len(rest[row]) - 1)]
                out[n] = torch.log_softmax(picked.float(), dim=-1).cpu().numpy()
    return np.stack([out[n] for n in range(len(prompts))])


def _prefill(worker: Any, tokens: list[int], parent: Any) -> Any:
    """A KV cache of `tokens` after `parent`'s (a copy: `parent` stays as it was)."""
    import copy

    import torch
    from transformers import DynamicCache

    cache = copy.deepcopy(parent) if parent is not None else DynamicCache()
    if tokens:
        ids = torch.as_tensor(tokens, dtype=torch.long, device=worker.device)[None]
        worker.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def _batches(prompts: list[list[int]], shared: int, size: int) -> list[list[int]]:
    """Runs of consecutive (sorted) prompts that share more than `shared` tokens, at most `size` each."""
    batches: list[list[int]] = []
    for n, prompt in enumerate(prompts):
        if batches and len(batches[-1]) < size and _common_prefix([prompts[batches[-1][0]], prompt]) > shared + 4:
            batches[-1].append(n)
        else:
            batches.append([n])
    return batches


def _common_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt begins with, leaving each at least one token of its own."""
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1 and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n
