"""Sequence packing for the update: a micro-batch's rows as one sequence, with no padding computed.

A right-padded micro-batch computes every row to its longest row's length; RL rows differ in length a lot
(a sample that stops early next to one that runs to max_tokens), and every pad position costs the decoder
as much as a real token, forward and backward. Packed, the rows are laid end to end in one row of exactly
their real tokens:

* **Plain rows.** Positions restart at 0 for each row, and no attention mask is passed: transformers finds
  the rows' boundaries from the positions and restricts attention to each row (a block-diagonal causal
  mask with SDPA; variable-length kernels with flash/flex attention, where the model has them).
* **Prompt-sharing groups** (`shared_prefix`). Each group is its prompt once, then each row's suffix, with
  positions continuing from the prompt, and a mask where a suffix sees its group's prompt and itself
  (causally), nothing of its siblings: the shared-prefix computation, without padding any prompt or suffix.

The log-probs come back in the padded frames (`[rows, width]`, and `shared_prefix`'s suffix frame), so the
loss and the log-probs reported are computed exactly as for the padded micro-batch: the same loss and
gradients to float rounding (tests/test_packing.py). The head runs on the trained tokens only
(`chunked_logprobs`).

`TINKERLESS_PACKING=1` turns it on. It is off by default until a GPU measurement shows it pays: on a CPU,
SDPA with a mask over the packed row does more attention work than the padded rows' own causal kernels.
"""

from __future__ import annotations

import os

import torch

from tinkerless.functions.training.chunked_logprobs import head_logprobs
from tinkerless.functions.training.picked_logits import scattered, trained_pairs

ENV = "TINKERLESS_PACKING"


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip() == "1"


def plain_logprobs(split: tuple, input_ids: torch.Tensor, lengths: list[int], mask: torch.Tensor, *,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of right-padded rows' trained tokens (others 0), the rows packed into one sequence."""
    device = input_ids.device
    starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)
    real = torch.arange(input_ids.shape[1], device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    ids = input_ids[real][None]  # row-major: row 0's tokens, then row 1's, ...
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    rows, columns = trained_pairs(mask)
    decoder, head = split
    hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]
    picked, entropy = head_logprobs(hidden[starts[rows] + columns - 1], head, input_ids[rows, columns],
                                    with_entropy=with_entropy)
    return scattered(picked, rows, columns, input_ids.shape), scattered(entropy, rows, columns, input_ids.shape)


def shared_logprobs(split: tuple, micro, tokens: list[list[int]], frame, mask: torch.Tensor, *,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`shared_prefix.suffix_logprobs`, packed: log-probs [R, S] of the suffix frame's trained tokens."""
    device = frame.tokens.device
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    group_of: list[torch.Tensor] = []
    branch_of: list[torch.Tensor] = []
    predicts_first: list[int] = []  # per frame row: the packed index of its prompt's last token
    suffix_start: list[int] = []  # per frame row: the packed index of its suffix's first token
    at, row, branch = 0, 0, 0
    for g, group in enumerate(micro.groups):
        prompt = torch.as_tensor(tokens[group.rows[0]][: group.prefix], dtype=torch.long)
        ids.append(prompt)
        positions.append(torch.arange(group.prefix))
        group_of.append(torch.full((group.prefix,), g))
        branch_of.append(torch.zeros(group.prefix, dtype=torch.long))
        prompt_last = at + group.prefix - 1
        at += group.prefix
        for _ in group.rows:
            length = frame.lengths[row]
            branch += 1
            ids.append(frame.tokens[row, :length].cpu())
            positions.append(torch.arange(group.prefix, group.prefix + length))
            group_of.append(torch.full((length,), g))
            branch_of.append(torch.full((length,), branch))
            predicts_first.append(prompt_last)
            suffix_start.append(at)
            at += length
            row += 1
    group_t, branch_t = torch.cat(group_of).to(device), torch.cat(branch_of).to(device)
    causal = torch.ones((at, at), dtype=torch.bool, device=device).tril()
    same_group = group_t[:, None] == group_t[None, :]
    visible = (branch_t[None, :] == 0) | (branch_t[:, None] == branch_t[None, :])
    attention = (causal & same_group & visible)[None, None]
    decoder, head = split
    hidden = decoder(input_ids=torch.cat(ids)[None].to(device), position_ids=torch.cat(positions)[None].to(device),
                     attention_mask=attention, use_cache=False).last_hidden_state[0]
    rows, columns = trained_pairs(mask, first=0)
    first = torch.tensor(predicts_first, device=device)[rows]
    body = torch.tensor(suffix_start, device=device)[rows] + columns - 1
    index = torch.where(columns == 0, first, body)
    picked, entropy = head_logprobs(hidden[index], head, frame.tokens[rows, columns], with_entropy=with_entropy)
    shape = frame.tokens.shape
    return scattered(picked, rows, columns, shape), scattered(entropy, rows, columns, shape)
