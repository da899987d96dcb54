"""Prompt scoring options of a Tinker sample request, from one forward pass over the prompt.

    prompt_logprobs          logprob of each prompt token given the ones before it (entry 0 is NaN)
    prompt_logprobs_last_n   score only the last N prompt tokens (earlier entries NaN / top-k rows empty)
    topk_prompt_logprobs     the k most likely tokens and their logprobs at each prompt position
    target_prompt_logprobs   logprobs of caller-chosen token ids, [len(prompt) - 1, K] (-1 = no request)
    prompt_alt_tokens_k      k draws, at the request's temperature, from each position's next-token distribution

Row i of every [len(prompt) - 1, K] tensor is the distribution over prompt token i + 1 (position 0
has no context). Every logprob is the model's own log-softmax (temperature 1), as the sampled-token
logprobs are, so they agree with a forward_backward on the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinkerless.errors import UserError
from tinkerless.wire.messages import GREEDY_BELOW

MAX_PROMPT_K = 1024  # top-k / target columns / alternative draws per position
TOPK_EMPTY_LOGPROB = -99999.0  # the SDK's sentinel for an empty top-k cell (token id 0)
_ROW_CHUNK = 256  # prompt positions per log-softmax


@dataclass
class PromptScoring:
    logprobs: bool = False
    last_n: int | None = None
    topk: int = 0
    targets: np.ndarray | None = None  # [n - 1, K] int64, -1 where nothing is asked
    target_csr: tuple[np.ndarray, np.ndarray] | None = None  # (crow, col) when the request was sparse
    alt_k: int = 0

    @property
    def needed(self) -> bool:
        return self.logprobs or self.topk > 0 or self.targets is not None or self.alt_k > 0

    @classmethod
    def parse(cls, body: dict, prompt_length: int, vocab_size: int) -> "PromptScoring":
        scoring = cls(logprobs=bool(body.get("prompt_logprobs")))
        scoring.topk = _count(body, "topk_prompt_logprobs", vocab_size)
        scoring.alt_k = _count(body, "prompt_alt_tokens_k", vocab_size)
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None:
            last_n = _integer(last_n, "prompt_logprobs_last_n")
            if not (scoring.logprobs or scoring.topk):
                raise UserError("prompt_logprobs_last_n needs prompt_logprobs (or topk_prompt_logprobs)",
                                hint="set include_prompt_logprobs=True, or drop prompt_logprobs_last_n")
            if not 1 <= last_n <= prompt_length - 1:
                raise UserError(f"prompt_logprobs_last_n={last_n} is out of range for a {prompt_length}-token prompt",
                                hint=f"use 1 to {max(prompt_length - 1, 1)} (len(prompt) - 1)")
            scoring.last_n = last_n
        if body.get("target_prompt_logprobs") is not None:
            scoring.targets, scoring.target_csr = _targets(body["target_prompt_logprobs"], prompt_length, vocab_size)
        if (scoring.topk or scoring.alt_k or scoring.targets is not None) and prompt_length < 2:
            raise UserError("prompt scoring needs a prompt of at least 2 tokens (the first has no context)")
        return scoring

    def compute(self, worker, policy: str, prompt: list[int], temperature: float, seed: int) -> dict:
        """{field name: value} for `convert.sample_response`, from one no-grad forward pass (scheduler thread)."""
        import torch

        with torch.no_grad(), worker._activate(policy):  # the worker's adapter switch, as its forward() uses it
            device = next(worker.model.parameters()).device
            logits = worker.model(input_ids=torch.tensor([prompt], device=device)).logits[0, :-1]
        rows = len(prompt) - 1  # row i: the distribution over prompt[i + 1]
        scored_from = 0 if self.last_n is None else rows - self.last_n
        logprobs = np.full(rows, np.nan, np.float32)
        top_ids = np.zeros((len(prompt), self.topk), np.int32)
        top_lps = np.full((len(prompt), self.topk), TOPK_EMPTY_LOGPROB, np.float32)
        targets = None if self.targets is None else np.zeros(self.targets.shape, np.float32)
        alt_tokens = np.zeros((rows, self.alt_k), np.int64)
        alt_lps = np.zeros((rows, self.alt_k), np.float32)
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
        following = torch.tensor(prompt[1:], device=device)
        # In row chunks: a full [len(prompt), vocab] log-softmax next to the logits would double the peak memory.
        for start in range(0, rows, _ROW_CHUNK):
            end = min(rows, start + _ROW_CHUNK)
            chunk = logits[start:end].float()
            logsoftmax = torch.log_softmax(chunk, dim=-1)
            if self.logprobs:
                logprobs[start:end] = logsoftmax.gather(1, following[start:end, None])[:, 0].cpu().numpy()
            if self.topk:
                top = logsoftmax.topk(self.topk, dim=-1)
                top_ids[1 + start:1 + end] = top.indices.cpu().numpy()
                top_lps[1 + start:1 + end] = top.values.cpu().numpy()
            if targets is not None:
                asked = torch.as_tensor(self.targets[start:end], device=device)
                targets[start:end] = logsoftmax.gather(1, asked.clamp(min=0)).cpu().numpy()
            if self.alt_k:
                if temperature >= GREEDY_BELOW:  # under it, dividing by it overflows: greedy, as sampling is
                    probs = torch.softmax(chunk.cpu() / temperature, dim=-1)
                    draws = torch.multinomial(probs, self.alt_k, replacement=True, generator=generator)
                else:  # greedy: every draw is the argmax
                    draws = chunk.cpu().argmax(dim=-1, keepdim=True).expand(-1, self.alt_k)
                alt_tokens[start:end] = draws.numpy()
                alt_lps[start:end] = logsoftmax.cpu().gather(1, draws).numpy()
        out: dict = {}
        if self.logprobs:
            logprobs[:scored_from] = np.nan
            out["prompt_logprobs"] = np.concatenate([[np.nan], logprobs]).astype(np.float32)
        if self.topk:
            top_ids[1:1 + scored_from] = 0
            top_lps[1:1 + scored_from] = TOPK_EMPTY_LOGPROB
            out["topk_prompt_logprobs"] = (top_ids, top_lps)
        if targets is not None:
            targets[self.targets < 0] = 0.0  # the SDK's documented value for a cell that asked nothing
            out["target_prompt_logprobs"] = (targets, self.target_csr)
        if self.alt_k:
            out["prompt_alt_tokens"] = (alt_tokens, alt_lps)
        return out


def _integer(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise UserError(f"{name} must be an integer, got {value!r}"[:200])
    return int(value)


def _count(body: dict, name: str, vocab_size: int) -> int:
    value = body.get(name)
    if value is None:
        return 0
    value = _integer(value, name)
    limit = min(MAX_PROMPT_K, vocab_size)
    if not 0 <= value <= limit:
        raise UserError(f"{name}={value} is out of range", hint=f"use 0 to {limit}")
    return value


def _targets(tensor, prompt_length: int, vocab_size: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """A JSON TensorData of token ids (dense or CSR) as a dense [n - 1, K] int64 matrix with -1 for empty cells."""
    hint = "send an int64 tensor of shape [len(prompt) - 1, K] (TensorData.from_numpy), -1 where nothing is asked"
    if not isinstance(tensor, dict):
        raise UserError("target_prompt_logprobs must be a TensorData object", hint=hint)
    if tensor.get("dtype") != "int64":
        raise UserError(f"target_prompt_logprobs must be int64 token ids, got dtype {tensor.get('dtype')!r}", hint=hint)
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise UserError(f"target_prompt_logprobs must be 2-D, got shape {shape!r}"[:200], hint=hint)
    rows, columns = shape
    if rows != prompt_length - 1:
        raise UserError(f"target_prompt_logprobs has {rows} rows for a {prompt_length}-token prompt", hint=hint)
    if not 1 <= columns <= MAX_PROMPT_K:
        raise UserError(f"target_prompt_logprobs has {columns} columns", hint=f"use 1 to {MAX_PROMPT_K}")
    data = _int_array(tensor.get("data"), "data")
    crow, col = tensor.get("sparse_crow_indices"), tensor.get("sparse_col_indices")
    if (crow is None) != (col is None):
        raise UserError("a sparse target_prompt_logprobs needs both sparse_crow_indices and sparse_col_indices")
    if crow is None:
        if data.size != rows * columns:
            raise UserError(f"target_prompt_logprobs has {data.size} values for shape {shape}", hint=hint)
        dense, csr = data.reshape(rows, columns), None
    else:
        crow, col = _int_array(crow, "sparse_crow_indices"), _int_array(col, "sparse_col_indices")
        if (len(crow) != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != len(col)
                or len(col) != len(data) or np.any((col < 0) | (col >= columns))):
            raise UserError("target_prompt_logprobs has inconsistent CSR indices",
                            hint="crow has len(prompt) entries from 0 to nnz, col indices lie in [0, K)")
        dense = np.full((rows, columns), -1, np.int64)
        dense[np.repeat(np.arange(rows), np.diff(crow)), col] = data
        csr = (crow, col)
    if np.any((dense < -1) | (dense >= vocab_size)):
        raise UserError(f"target_prompt_logprobs holds token ids outside [0, {vocab_size}) (or -1 for none)")
    return dense, csr


def _int_array(values, name: str) -> np.ndarray:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise UserError(f"target_prompt_logprobs.{name} must be a list of integers")
    try:
        return np.asarray(values, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise UserError(f"target_prompt_logprobs.{name} holds a number out of the int64 range") from None
