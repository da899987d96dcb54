"""Top-k forward-KL distillation: a teacher's k most likely next tokens at each position, and the student's loss
against them.

    teacher_topk     the teacher's top-k ids and log-probs at every position of each datum, and its log-prob of
                     each datum's own next token, from one pass of the decoder (no grad)
    topk_backward    the `topk_forward_kl` loss, per trained (sampled) position t:

        KL_k(p_T || p_S)_t = sum_{v in topk_T(t)} q_T(v) * (log q_T(v) - log p_S(v))

    where q_T is the teacher's distribution renormalized over its own top k (the mass it puts outside them is
    unknown to the student's loss), and p_S is the student's full log-softmax read at those k ids. The mean over
    the batch's trained positions is backpropagated (token normalization). The student's sampled tokens are the
    positions: the student samples as usual, the teacher's distribution at each is the target.
"""

from __future__ import annotations

import numpy as np
import torch

from tinkerless.errors import UserError
from tinkerless.wire.messages import Datum


ROW_CHUNK = 256  # positions whose [V] log-softmax is held at once: a long sequence never holds [T, V]


def _next_token_logprobs(model, tokens: np.ndarray, rows: torch.Tensor) -> torch.Tensor:
    """log-softmax of the model's prediction of token r at each r in `rows` ([len(rows), V], in fp32)."""
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=device)[None]
    logits = model(input_ids=input_ids, logits_to_keep=(rows - 1).to(device), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _topk_rows(model, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The top k of every position's next-token distribution, and the log-prob of the token that follows (column
    0: 0, as `training.forward` gives), the output head run ROW_CHUNK positions at a time over one pass of the
    decoder (`picked_logits.decoder_and_head`), else a forward per chunk."""
    from tinkerless.functions.training.picked_logits import decoder_and_head

    n = len(tokens)
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=device)[None]
    split = decoder_and_head(model)
    hidden = split[0](input_ids=input_ids, use_cache=False).last_hidden_state[0] if split is not None else None
    ids = np.zeros((n, k), np.int32)
    lps = np.zeros((n, k), np.float32)
    picked = np.zeros(n, np.float32)
    targets = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=device)
    for start in range(1, n, ROW_CHUNK):
        rows = torch.arange(start, min(n, start + ROW_CHUNK))
        if hidden is not None:
            logprobs = torch.log_softmax(split[1](hidden[(rows - 1).to(device)]).float(), dim=-1)
        else:
            logprobs = _next_token_logprobs(model, tokens, rows)
        top = torch.topk(logprobs, k=min(k, logprobs.shape[-1]), dim=-1)
        ids[rows.numpy(), : top.indices.shape[1]] = top.indices.cpu().numpy()
        lps[rows.numpy(), : top.values.shape[1]] = top.values.cpu().numpy()
        picked[rows.numpy()] = logprobs.gather(1, targets[rows.to(device)][:, None])[:, 0].cpu().numpy()
    return ids, lps, picked


def teacher_topk(model, data: list[Datum], k: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per datum: its tokens' log-probs ([N], what `training.forward` returns: a teacher's forward needs no second
    pass for them), and the [N, k] ids and log-probs of the k most likely tokens at each position (row 0 zeros)."""
    picked_out, ids_out, lps_out = [], [], []
    with torch.no_grad():
        for datum in data:
            ids, lps, picked = _topk_rows(model, datum.tokens, k)
            picked_out.append(picked)
            ids_out.append(ids)
            lps_out.append(lps)
    return picked_out, ids_out, lps_out


def topk_kl(student: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per position: KL of the teacher's top-k (renormalized) to the student, from the student's log-softmax."""
    q = torch.softmax(teacher_logprobs, dim=-1)
    log_q = torch.log_softmax(teacher_logprobs, dim=-1)
    return (q * (log_q - student.gather(-1, teacher_ids))).sum(-1)


def topk_backward(model, data: list[Datum]) -> dict[str, float]:
    """Accumulate the gradient of the batch's mean top-k forward KL over trained positions; its metrics."""
    for i, datum in enumerate(data):
        if datum.target_topk_ids is None or datum.target_topk_logprobs is None:
            raise UserError(f"datum {i} has no target_topk_ids / target_topk_logprobs, which topk_forward_kl needs",
                            hint="ask the teacher's forward for topk=k and put its rows on the datum")
    positions = [np.nonzero(np.asarray(d.mask) > 0)[0] for d in data]
    positions = [p[p >= 1] for p in positions]  # position 0 has no prefix
    total = float(sum(len(p) for p in positions))
    kl_sum = 0.0
    for datum, rows in zip(data, positions):
        if not len(rows):
            continue
        index = torch.as_tensor(rows, dtype=torch.long)
        student = _next_token_logprobs(model, datum.tokens, index)
        device = student.device
        ids = torch.as_tensor(np.asarray(datum.target_topk_ids, dtype=np.int64)[rows], device=device)
        lps = torch.as_tensor(np.asarray(datum.target_topk_logprobs, dtype=np.float32)[rows], device=device)
        kl = topk_kl(student, ids, lps)
        (kl.sum() / max(total, 1.0)).backward()
        kl_sum += float(kl.detach().sum())
    mean = kl_sum / max(total, 1.0)
    return {"loss": mean, "topk_kl": mean, "tokens": total}
