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


def tag_words(tokenizer: Any) -> list[str]:
    """The words a fence tag is spelled in on this tokenizer: lowercase words of 4-12 letters that are one token
    each with their leading space (and alone, so a tag's words stay separate tokens): a tag of three of SmolLM2's
    19,445 is 43 bits in 3 tokens, where 8 hex digits (32 bits) are 9. Sorted, so a tag is the same on every worker
    with this tokenizer. Empty for a tokenizer without such words (bytes): the tag is then hex."""
    vocab = tokenizer.get_vocab()
    candidates = sorted({text for text in (tokenizer.decode([i]) for i in vocab.values())
                         if text.startswith(" ") and 4 <= len(text) - 1 <= 12 and text[1:].isascii()
                         and text[1:].isalpha() and text[1:].islower()})
    if not candidates:
        return []
    encoded = tokenizer(candidates, add_special_tokens=False)["input_ids"]
    return [text[1:] for text, ids in zip(candidates, encoded) if len(ids) == 1]


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
    if getattr(worker, "judge_tag_words", None) is None:
        worker.judge_tag_words = tag_words(worker.tokenizer)
    stats = judge_episodes(
        episodes, spec, judge_model=spec.model or (spec.endpoint or worker.model_name), cache=worker.judge_cache,
        score_tokens=None if spec.endpoint else worker._next_token_logprobs, tokenizer=worker.tokenizer,
        render=worker.chat.render, fail=mark_failed, tag_words=worker.judge_tag_words,
    )
    return stats.as_stats()


# Query tokens per packed forward: enough that a step's questions take a few forwards, few enough that the
# attention a packed forward computes and masks out (every token against every other in the pack) stays small
# beside the linear layers' work.
PACK_TOKENS = 256


def next_token_logprobs(worker: Any, prompts: list[list[int]]) -> np.ndarray:
    """The worker's base model's log-probs of the token after each prompt ([n, vocab]): the judge's verdict
    distribution. Every token the prompts share is computed once. Their common beginning (the instructions and
    rubric) is one KV cache, kept on the worker for the next call (the base model's weights never change);
    prompts about the same task (consecutive in sorted order) are one segment: the task's part (the task and
    the opening fence) once, then each prompt's own rest (the graded text, the closing fence, the end of turn).
    Segments are packed end to end into forwards with a block mask: a token sees the common beginning, its
    segment's task part and its own prompt's earlier tokens, nothing else, and no row is padded."""
    import torch

    from tinkerless.wire.messages import BASE_POLICY

    shared = _common_prefix(prompts)
    order = sorted(range(len(prompts)), key=lambda n: prompts[n])
    out: dict[int, np.ndarray] = {}
    with torch.no_grad(), worker._activate(BASE_POLICY):
        root = _root_cache(worker, prompts[0][:shared])
        segments, large = [], []
        for batch in _batches([prompts[n] for n in order], shared, len(prompts)):
            rows = [order[n] for n in batch]
            common = _common_prefix([prompts[n] for n in rows])
            segment = (prompts[rows[0]][shared:common], [(n, prompts[n][common:]) for n in rows])
            (large if _size(segment) > PACK_TOKENS else segments).append(segment)
        for pack in _packs(segments):
            _run_pack(worker, pack, root, shared, out)
        for part, rows in large:  # too large to pack whole (a packed forward's attention grows with its square):
            if part:  # its task part cached once,
                worker.model(input_ids=torch.as_tensor(part, dtype=torch.long, device=worker.device)[None],
                             past_key_values=root, use_cache=True, logits_to_keep=1)
            for pack in _packs([([], [row]) for row in rows]):  # its rows packed on top
                _run_pack(worker, pack, root, shared + len(part), out)
            _cut(root, shared)
    return np.stack([out[n] for n in range(len(prompts))])


def _root_cache(worker: Any, tokens: list[int]) -> Any:
    """A KV cache of `tokens` (the call's common beginning), the caller's own to extend: what it shares with
    the last call's is copied from the worker (the instructions and rubric are the same every step), the rest
    computed."""
    import copy

    import torch
    from transformers import DynamicCache

    kept = getattr(worker, "judge_root", None)
    reuse = 0
    if kept is not None and kept[0] is worker.model:
        limit = min(len(kept[1]), len(tokens))
        while reuse < limit and kept[1][reuse] == tokens[reuse]:
            reuse += 1
    cache = DynamicCache()
    if reuse:
        cache = copy.deepcopy(kept[2])
        _cut(cache, reuse)
    if len(tokens) > reuse:
        ids = torch.as_tensor(tokens[reuse:], dtype=torch.long, device=worker.device)[None]
        worker.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if tokens:
        worker.judge_root = (worker.model, tuple(tokens), copy.deepcopy(cache))
    return cache


def _run_pack(worker: Any, pack: list, cache: Any, cached: int, out: dict[int, np.ndarray]) -> None:
    """One packed forward on top of `cache` (holding `cached` tokens, as it does again after): each prompt's
    next-token log-probs into `out`."""
    import torch

    ids, positions, mask, lasts = _packed_inputs(pack, cached, worker)
    keep = torch.as_tensor(list(lasts.values()), device=worker.device)
    logits = worker.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                          use_cache=True, logits_to_keep=keep).logits
    _cut(cache, cached)
    for k, n in enumerate(lasts):
        out[n] = torch.log_softmax(logits[0, k].float(), dim=-1).cpu().numpy()


def _cut(cache: Any, length: int) -> None:
    """`cache` back to its first `length` tokens."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _size(segment: tuple[list[int], list[tuple[int, list[int]]]]) -> int:
    return len(segment[0]) + sum(len(rest) for _, rest in segment[1])


def _packs(segments: list[tuple[list[int], list[tuple[int, list[int]]]]]) -> list[list]:
    """Consecutive segments in forwards of at most PACK_TOKENS query tokens (a larger segment alone)."""
    packs: list[list] = []
    size = 0
    for segment in segments:
        tokens = _size(segment)
        if packs and size + tokens <= PACK_TOKENS:
            packs[-1].append(segment)
            size += tokens
        else:
            packs.append([segment])
            size = tokens
    return packs


def _packed_inputs(pack: list, shared: int, worker: Any) -> tuple[Any, Any, Any, dict[int, int]]:
    """One forward's input ids and positions ([1, q]), its additive attention mask ([1, 1, q, shared + q]: every
    token sees the cached common beginning, its segment's task part and its own prompt's earlier tokens), and
    where each prompt's last token is (prompt index -> position in the pack)."""
    import torch

    ids: list[int] = []
    positions: list[int] = []
    spans: list[tuple[int, int, int, int]] = []  # (start, end, and the task part it sees besides itself) per piece
    lasts: dict[int, int] = {}
    for part, rows in pack:
        part_start = len(ids)
        ids += part
        positions += range(shared, shared + len(part))
        part_end = len(ids)
        spans.append((part_start, part_end, part_start, part_start))
        for n, rest in rows:
            start = len(ids)
            ids += rest
            positions += range(shared + len(part), shared + len(part) + len(rest))
            spans.append((start, len(ids), part_start, part_end))
            lasts[n] = len(ids) - 1
    q = len(ids)
    allowed = torch.zeros((q, shared + q), dtype=torch.bool)
    allowed[:, :shared] = True
    causal = torch.ones((q, q), dtype=torch.bool).tril()
    for start, end, part_start, part_end in spans:
        block = allowed[start:end, shared:]
        block[:, part_start:part_end] = True  # a prompt's own rest sees its task part whole (the part: nothing)
        block[:, start:end] = causal[: end - start, : end - start]
    dtype = next(worker.model.parameters()).dtype
    mask = torch.zeros((q, shared + q), dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    device = worker.device
    return (torch.as_tensor(ids, dtype=torch.long, device=device)[None],
            torch.as_tensor(positions, dtype=torch.long, device=device)[None],
            mask[None, None].to(device), lasts)


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
