"""A teacher's log-probs for a student's sampled tokens when the two models tokenize differently.

The student's episode is turned back into chat messages whose assistant contents are exactly the text the
student sampled (its sampled ids decoded), rendered with the *teacher's* chat template, and tokenized by the
teacher with character offsets. Each sampled turn is found in that rendering, and the student's tokens of the
turn are matched to the teacher's by character spans:

* a *chunk* ends wherever a student token and a teacher token end at the same character of the turn; the
  smallest such chunks partition the turn. A one-to-one chunk pairs one student token with one teacher token;
  a many-to-many chunk (a word split differently, a multi-byte character the student spelled in bytes) gets
  the chunk's log-prob difference spread evenly over its student tokens, so the per-token advantages of a
  chunk sum to log p_teacher(chunk) - log p_student(chunk), the chunk's reverse-KL term;
* the student's end-of-turn token pairs with the teacher's, when the teacher's template closes the turn with
  a special token right after the content;
* anything else cannot be aligned: bytes the student drew that are no UTF-8, and the rest of their turn (the
  teacher would read the replacement character's bytes instead, so its history differs), a turn the template rewrites (so its text is not found), a teacher token
  that straddles the turn's edge, a zero-width token inside a turn, tokens after the last common boundary.
  Those tokens are masked (they do not train) and counted.

Tool calls are text the student sampled, so they align like any other content; tool results and env
observations are context (mask 0), rendered by the teacher's template as the messages they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


# What decoding writes for bytes that are no UTF-8: the teacher would read (and score) this character's own
# bytes, not the ones the student drew, so from the first one on the rest of the turn is not aligned (the
# teacher's history there is not the student's).
UNREADABLE = "\ufffd"


@dataclass
class TeacherRendering:
    """One student sequence as the teacher sees it, and how to map the teacher's log-probs back."""

    tokens: list[int]  # the teacher's tokens of the re-rendered conversation
    # Per aligned unit: (student positions, teacher positions). Filled by `align`.
    units: list[tuple[list[int], list[int]]] = field(default_factory=list)
    sampled: int = 0  # the student's sampled tokens in this sequence
    reason: str | None = None  # why nothing aligned (None when something did)


def sampled_turns(mask: np.ndarray) -> list[list[int]]:
    """The positions of each maximal run of sampled (mask > 0) tokens: one run per assistant turn."""
    turns: list[list[int]] = []
    previous = False
    for position, on in enumerate(np.asarray(mask) > 0):
        if on and not previous:
            turns.append([])
        if on:
            turns[-1].append(position)
        previous = bool(on)
    return turns


def _special_ids(tokenizer: Any) -> set[int]:
    return {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}


def _char_ends(tokenizer: Any, ids: list[int], specials: set[int]) -> tuple[str, list[int | None]]:
    """The turn's text and, per token, where its text ends in it: None for a special token, or where a token
    leaves the text mid-character (a byte of a multi-byte character), so that no boundary falls inside."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    ends: list[int | None] = []
    for i, token in enumerate(ids):
        if token in specials:
            ends.append(None)
            continue
        prefix = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        ends.append(len(prefix) if text.startswith(prefix) and not prefix.endswith("\ufffd") else None)
    return text, ends


def render_for_teacher(
    teacher_tokenizer: Any, transcript: list[dict], turn_texts: list[str]
) -> tuple[str, list[int | None]] | None:
    """The conversation with its assistant turns' contents set to `turn_texts`, in the teacher's chat template,
    and where each turn's content starts in it (None for a turn the template did not write verbatim).
    None when the transcript's assistant messages are not the sampled turns (then nothing aligns)."""
    messages = [dict(m) for m in transcript if isinstance(m, dict) and isinstance(m.get("content"), str)]
    if len(messages) != len(transcript):
        return None  # structured contents (tool_calls objects, images): not re-rendered here
    assistants = [m for m in messages if m.get("role") == "assistant"]
    if len(assistants) != len(turn_texts):
        return None
    for message, text in zip(assistants, turn_texts):
        message["content"] = text
    try:
        rendered = teacher_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception:  # a template that refuses these roles (e.g. no system message): nothing aligns
        return None
    starts: list[int | None] = []
    cursor = 0
    for text in turn_texts:
        found = rendered.find(text, cursor)
        starts.append(None if found < 0 else found)
        if found >= 0:
            cursor = found + len(text)
    return rendered, starts


def align(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    tokens: np.ndarray,
    mask: np.ndarray,
    transcript: list[dict],
) -> TeacherRendering:
    """Re-render one student sequence for the teacher and pair its sampled tokens with teacher tokens."""
    tokens = [int(t) for t in np.asarray(tokens)]
    turns = sampled_turns(mask)
    sampled = sum(len(t) for t in turns)
    student_specials = _special_ids(student_tokenizer)
    decoded = [_char_ends(student_tokenizer, [tokens[p] for p in turn], student_specials) for turn in turns]
    rendered = render_for_teacher(teacher_tokenizer, transcript, [text for text, _ in decoded])
    if rendered is None:
        return TeacherRendering([], sampled=sampled, reason="the transcript's assistant turns are not the sampled turns")
    text, starts = rendered
    encoding = teacher_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    teacher_ids = list(encoding["input_ids"])
    offsets = [tuple(o) for o in encoding["offset_mapping"]]
    teacher_specials = _special_ids(teacher_tokenizer)
    result = TeacherRendering(teacher_ids, sampled=sampled)
    for turn, (turn_text, ends), start in zip(turns, decoded, starts):
        if start is None:
            continue
        result.units.extend(_align_turn(turn, [tokens[p] for p in turn], ends, turn_text, start, offsets,
                                        teacher_ids, student_specials, teacher_specials))
    return result


def _align_turn(
    positions: list[int], ids: list[int], ends: list[int | None], text: str, start: int,
    offsets: list[tuple[int, int]], teacher_ids: list[int], student_specials: set[int], teacher_specials: set[int],
) -> list[tuple[list[int], list[int]]]:
    stop = start + len(text)
    # Teacher tokens inside the turn's content, by where they end (relative to the turn); a token that starts
    # before the content or runs past it is no boundary of the turn.
    inside = {}
    for j, (a, b) in enumerate(offsets):
        if a >= start and b <= stop and b > a and teacher_ids[j] not in teacher_specials:
            inside[b - start] = j
    units: list[tuple[list[int], list[int]]] = []
    chunk_start = 0  # relative character where the open chunk begins
    chunk: list[int] = []
    for k, (position, end) in enumerate(zip(positions, ends)):
        if ids[k] in student_specials:
            chunk = []  # a special token inside a chunk leaves the chunk unalignable
            if k == len(ids) - 1 and chunk_start == len(text):
                closing = _closing_token(offsets, teacher_ids, stop, teacher_specials)
                if closing is not None:
                    units.append(([position], [closing]))
            continue
        chunk.append(position)
        if end is None or end <= chunk_start or end not in inside:
            continue
        if UNREADABLE in text[chunk_start:end]:
            break  # past bytes that are no text the two histories differ: the rest of the turn is not aligned
        teacher = _covering(offsets, start + chunk_start, start + end)
        if teacher and not any(teacher_ids[j] in teacher_specials for j in teacher):
            units.append((chunk, teacher))
        chunk, chunk_start = [], end
    return units


def _covering(offsets: list[tuple[int, int]], a: int, b: int) -> list[int] | None:
    """The teacher tokens that spell exactly the characters [a, b); None if they do not (a token reaching
    outside, or a gap). Byte-level tokenizers give every token of a multi-byte character that character's
    span, so tokens may share a span; they may not leave a character uncovered."""
    tokens = [j for j, (x, y) in enumerate(offsets) if y > x and x < b and y > a]
    if not tokens or any(offsets[j][0] < a or offsets[j][1] > b for j in tokens):
        return None
    reached = a
    for j in tokens:  # in order of the text
        if offsets[j][0] > reached:
            return None
        reached = max(reached, offsets[j][1])
    return tokens if reached == b else None


def _closing_token(offsets: list[tuple[int, int]], teacher_ids: list[int], stop: int, specials: set[int]) -> int | None:
    """The teacher's special token that starts right where the turn's content ends (its end of turn)."""
    for j, (a, _) in enumerate(offsets):
        if a == stop and teacher_ids[j] in specials:
            return j
        if a > stop:
            break
    return None


def map_back(rendering: TeacherRendering, teacher_logprobs: np.ndarray, sampler_logprobs: np.ndarray,
             length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per student token: the teacher's log-prob as the units define it, and 1 where it is aligned."""
    out = np.zeros(length, dtype=np.float32)
    aligned = np.zeros(length, dtype=np.float32)
    student = np.asarray(sampler_logprobs, dtype=np.float64)
    teacher = np.asarray(teacher_logprobs, dtype=np.float64)
    for positions, teacher_positions in rendering.units:
        difference = float(teacher[teacher_positions].sum() - student[positions].sum()) / len(positions)
        for p in positions:
            out[p] = student[p] + difference
            aligned[p] = 1.0
    return out, aligned
