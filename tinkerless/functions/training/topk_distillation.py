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
BATCHED_ROWS = 1024  # the update's [rows x positions, V] log-softmax held at once, above which it goes row by row


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


def topk_backward(model, data: list[Datum], micro_batch_size: int = 16, pad_id: int = 0) -> dict[str, float]:
    """Accumulate the gradient of the batch's mean top-k forward KL over trained positions; its metrics.

    Sequences of similar length share a right-padded pass (`plan_micro_batches`, at most `micro_batch_size` rows),
    the output head run only at the positions some row trains (as `forward_backward` does); a micro-batch whose
    [rows x positions, V] would exceed BATCHED_ROWS goes one sequence at a time. The same loss either way."""
    from tinkerless.functions.training.forward_backward import make_batch
    from tinkerless.functions.training.micro_batches import plan_micro_batches

    for i, datum in enumerate(data):
        if datum.target_topk_ids is None or datum.target_topk_logprobs is None:
            raise UserError(f"datum {i} has no target_topk_ids / target_topk_logprobs, which topk_forward_kl needs",
                            hint="ask the teacher's forward for topk=k and put its rows on the datum")
    positions = [np.nonzero(np.asarray(d.mask) > 0)[0] for d in data]
    positions = [p[p >= 1] for p in positions]  # position 0 has no prefix
    count = float(sum(len(p) for p in positions))
    total = max(count, 1.0)
    device = next(model.parameters()).device
    kl_sum = 0.0
    for micro in plan_micro_batches([len(d.tokens) for d in data], micro_batch_size, model):
        rows = [i for i in micro.rows if len(positions[i])]
        union = np.unique(np.concatenate([positions[i] for i in rows])) if rows else np.zeros(0, np.int64)
        chunks = [rows] if len(rows) * len(union) <= BATCHED_ROWS else [[i] for i in rows]
        for chunk in chunks:
            if not chunk:
                continue
            keep = np.unique(np.concatenate([positions[i] for i in chunk]))
            batch = make_batch([data[i] for i in chunk], pad_id, device)
            # No attention mask: right-padded and causal, a real position never sees a pad (`token_logprobs`).
            logits = model(input_ids=batch.input_ids, logits_to_keep=torch.as_tensor(keep - 1, device=device),
                           use_cache=False).logits
            student = torch.log_softmax(logits.float(), dim=-1)  # [rows, len(keep), V]
            loss = student.new_zeros(())
            for row, i in enumerate(chunk):
                rows_i = positions[i]
                ids = torch.as_tensor(np.asarray(data[i].target_topk_ids, dtype=np.int64)[rows_i], device=device)
                lps = torch.as_tensor(np.asarray(data[i].target_topk_logprobs, dtype=np.float32)[rows_i], device=device)
                kl = topk_kl(student[row, torch.as_tensor(np.searchsorted(keep, rows_i), device=device)], ids, lps)
                loss = loss + kl.sum()
                kl_sum += float(kl.detach().sum())
            (loss / total).backward()
    mean = kl_sum / total
    return {"loss": mean, "topk_kl": mean, "tokens": count}
