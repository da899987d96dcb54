"""On-policy distillation (OPD): the policy samples as usual, a teacher scores every sampled token, and the
per-token reverse KL is the advantage (the tinker-cookbook's form):

    A_t = distill_coef * (log p_teacher(x_t) - log p_student(x_t))  +  the env reward's group advantage

where log p_student is the sampler's own log-prob of the token it drew (the "true log-prob" the update's
importance ratio uses). With no reward (or a constant one) only the teacher's term is left.

`TrainConfig(teacher=...)` names the teacher (`TEACHER_FORMS`). It runs as a forward function on the backend
next to the policy:

* `base`, or the student's own base model named by id or directory: the policy's worker with every adapter off;
* `RUN@STEP` / `RUN@latest`, a checkpoint of a run on the same base (the student's own earlier one included):
  loaded once as a second adapter on the policy's worker, so the forward runs wherever the policy does (in
  process, on `tinkerless serve`, in Modal's `Forward` class, on a SkyPilot cluster's server);
* another model id or directory: a second model on this machine (the local backend), one of the extra models
  `tinkerless serve --also-model` holds (a server, a SkyPilot cluster's server), or Modal's `Forward` class
  holding it; with its own tokenizer when it has one (then `functions.companions.alignment` re-renders and
  aligns the student's text), the one loaded where the model is;
* `http(s)://...`: an OpenAI-compatible endpoint that returns prompt log-probs (`functions.companions.endpoint`).

Its compute is the run's `teacher` phase (`accounting.PHASES`), apart from the policy's own forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tinkerless.errors import ConfigError, UserError
from tinkerless.wire.messages import BASE_POLICY, Datum, Episode

TEACHER_FORMS = ("'base', a model id or directory, a checkpoint RUN@STEP or RUN@latest (the student's own earlier "
                 "one too), or an OpenAI-compatible endpoint URL (http://host:port/v1, optionally #model=NAME)")
TEACHER_POLICY = "teacher"  # the teacher adapter's name on the policy's worker (in the run's namespace)


@dataclass
class SequenceScores:
    """A teacher's view of one trained sequence: its log-prob of each token, and where it is aligned."""

    logprobs: np.ndarray  # float32 [N]: the teacher's log-prob of each student token (0 where not aligned)
    aligned: np.ndarray  # float32 [N]: 1 on the sampled tokens the teacher scored


def teacher_kind(spec: str) -> str:
    """"endpoint", "checkpoint", "base" or "model", from the spec's form alone (no I/O)."""
    from pathlib import Path

    if spec.startswith(("http://", "https://")):
        return "endpoint"
    if spec == "base":
        return "base"
    if "@" in spec and not Path(spec).expanduser().is_dir():
        return "checkpoint"
    return "model"


DISTILL_LOSSES = ("reverse_kl", "topk_forward_kl")
MAX_TOPK = 1024


def check_teacher(spec: Any, distill_coef: Any, distill_loss: Any = "reverse_kl", distill_topk: Any = 64) -> None:
    """ConfigError for a teacher setting that cannot be right, before anything loads."""
    if distill_loss not in DISTILL_LOSSES:
        raise ConfigError(f"distill_loss must be one of {', '.join(DISTILL_LOSSES)}, got {distill_loss!r}")
    if isinstance(distill_topk, bool) or not isinstance(distill_topk, int) or not 1 <= distill_topk <= MAX_TOPK:
        raise ConfigError(f"distill_topk must be a whole number from 1 to {MAX_TOPK}, got {distill_topk!r}")
    if distill_loss == "topk_forward_kl" and spec is not None and teacher_kind(str(spec).strip()) in ("endpoint", "model"):
        raise ConfigError(f"distill_loss='topk_forward_kl' needs a teacher with the student's tokenizer on its worker, "
                          f"not {spec!r}", hint="a checkpoint RUN@STEP of the same base, or 'base'")
    if spec is not None:
        if not isinstance(spec, str) or not spec.strip() or len(spec) > 2000:
            raise ConfigError(f"teacher must be a non-empty string, got {spec!r}", hint=f"one of: {TEACHER_FORMS}")
        if teacher_kind(spec.strip()) == "checkpoint":
            from tinkerless.sdk.checkpoints.checkpoint_ref import parse_checkpoint

            try:
                parse_checkpoint(spec.strip())
            except UserError as exc:
                raise ConfigError(f"teacher={spec!r}: {exc.message}", hint=f"one of: {TEACHER_FORMS}") from None
    if isinstance(distill_coef, bool) or not isinstance(distill_coef, (int, float)) or not math.isfinite(distill_coef) \
            or distill_coef < 0:
        raise ConfigError(f"distill_coef must be a finite number >= 0, got {distill_coef!r}",
                          hint="the weight of the teacher's per-token term in the advantage; 1.0 is the cookbook's")


class Teacher:
    """Scores the sampled tokens of a step's episodes. `same_tokenizer`: scores are token for token."""

    description = "teacher"
    same_tokenizer = True

    def score(self, episodes: list[Episode]) -> list[list[SequenceScores]]:
        raise NotImplementedError


def _sequence_datums(episodes: list[Episode]) -> tuple[list[Datum], list[tuple[int, int]]]:
    data, where = [], []
    for i, episode in enumerate(episodes):
        for j, sequence in enumerate(episode.sequences()):
            data.append(Datum(tokens=sequence.tokens, mask=sequence.mask))
            where.append((i, j))
    return data, where


def _regroup(episodes: list[Episode], where: list[tuple[int, int]], scores: list[SequenceScores]) -> list[list[SequenceScores]]:
    out: list[list[SequenceScores]] = [[] for _ in episodes]
    for (i, _), score in zip(where, scores):
        out[i].append(score)
    return out


class ForwardTeacher(Teacher):
    """A teacher with the student's tokenizer, scored by a `forward` call on a backend: the policy's own worker
    (a checkpoint's adapter, or the base with adapters off), or a second model's worker."""

    def __init__(self, client: Any, description: str):
        self.client = client  # a TrainingClient whose policy is the teacher (or BASE_POLICY)
        self.description = description

    def score(self, episodes: list[Episode]) -> list[list[SequenceScores]]:
        data, where = _sequence_datums(episodes)
        if not data:
            return [[] for _ in episodes]
        logprobs = self.client.forward(data).logprobs
        scores = [SequenceScores(np.asarray(lp, dtype=np.float32), (d.mask > 0).astype(np.float32))
                  for lp, d in zip(logprobs, data)]
        return _regroup(episodes, where, scores)


class AligningTeacher(Teacher):
    """A teacher with a tokenizer of its own: each sequence re-rendered with its chat template and aligned by
    character spans (`functions.companions.alignment`); `forward` gives its log-probs of its own tokens."""

    same_tokenizer = False

    def __init__(self, forward: Any, student_tokenizer: Any, teacher_tokenizer: Any, description: str):
        self.forward = forward  # list[Datum] -> list of per-token log-prob arrays, in the teacher's tokens
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizer = teacher_tokenizer
        self.description = description

    def score(self, episodes: list[Episode]) -> list[list[SequenceScores]]:
        from tinkerless.functions.companions.alignment import align, map_back

        renderings, where = [], []
        for i, episode in enumerate(episodes):
            for j, sequence in enumerate(episode.sequences()):
                # Only the first sequence is the transcript's conversation; an agent's rewritten contexts are not.
                transcript = episode.transcript if j == 0 else []
                renderings.append(align(self.student_tokenizer, self.teacher_tokenizer, sequence.tokens,
                                        sequence.mask, transcript))
                where.append((i, j))
        scored = [r for r in renderings if r.units]
        logprobs = iter(self.forward([Datum(tokens=np.asarray(r.tokens, dtype=np.int32),
                                            mask=np.zeros(len(r.tokens), dtype=np.float32)) for r in scored])
                        if scored else [])
        scores = []
        for (i, j), rendering in zip(where, renderings):
            sequence = episodes[i].sequences()[j]
            length = len(sequence.tokens)
            if rendering.units:
                lp, aligned = map_back(rendering, next(logprobs), sequence.sampler_logprobs, length)
            else:
                lp, aligned = np.zeros(length, np.float32), np.zeros(length, np.float32)
            scores.append(SequenceScores(lp, aligned))
        return _regroup(episodes, where, scores)


class EndpointTeacher(Teacher):
    """A teacher at an OpenAI-compatible endpoint: each sequence's text scored there (prompt log-probs), its
    tokens paired with the student's by character spans (`functions.companions.endpoint`)."""

    same_tokenizer = False

    def __init__(self, spec: str, student_tokenizer: Any, **options: Any):
        from tinkerless.functions.companions.endpoint import EndpointScorer

        self.scorer = EndpointScorer(spec, student_tokenizer, **options)
        self.description = self.scorer.description

    def score(self, episodes: list[Episode]) -> list[list[SequenceScores]]:
        from tinkerless.functions.companions.alignment import map_back

        out = []
        for episode in episodes:
            scores = []
            for sequence in episode.sequences():
                rendering, logprobs = self.scorer.align(sequence.tokens, sequence.mask)
                lp, aligned = map_back(rendering, logprobs, sequence.sampler_logprobs, len(sequence.tokens))
                scores.append(SequenceScores(lp, aligned))
            out.append(scores)
        return out


def open_teacher(config: Any, backend: Any, namespace: str, host: Any, usage: Any, say: Any = print) -> Teacher | None:
    """A run's teacher (None without one), loaded where it runs, its seconds metered as `usage`'s teacher phase."""
    if config.teacher is None:
        return None
    teacher = load_teacher(config.teacher, model=config.model, backend=backend, namespace=namespace, host=host,
                           usage=usage)
    say(f"distilling from {teacher.description}")
    return teacher


def teacher_clients(teacher: Teacher | None) -> list[Any]:
    """The teacher's adapter on the policy's worker when it is a checkpoint: freed with the run's policies."""
    client = getattr(teacher, "client", None)
    return [client] if client is not None and client.namespace else []


def load_teacher(spec: str, *, model: str, backend: Any, namespace: str, host: Any, usage: Any) -> Teacher:
    """The teacher `spec` names, loaded where it runs (see the module docstring)."""
    from tinkerless.sdk.backends.client import TrainingClient
    from tinkerless.sdk.checkpoints.checkpoint_ref import same_model

    spec = spec.strip()
    kind = teacher_kind(spec)
    if kind == "endpoint":
        return EndpointTeacher(spec, _tokenizer(model))
    if kind == "base" or (kind == "model" and same_model(spec, model)):
        return ForwardTeacher(TrainingClient(backend, BASE_POLICY, create=False), f"the base model {model}")
    if kind == "checkpoint":
        return ForwardTeacher(_load_checkpoint(spec, backend, namespace, host, model), f"checkpoint {spec}")
    return _second_model(spec, model, backend, usage)


def _load_checkpoint(spec: str, backend: Any, namespace: str, host: Any, model: str) -> Any:
    """A run's checkpoint as the `teacher` adapter on the policy's worker; refused unless it is of this base."""
    from tinkerless.errors import TinkerlessError
    from tinkerless.sdk.backends.client import TrainingClient
    from tinkerless.sdk.checkpoints.checkpoint_ref import check_base_model, find_run, parse_checkpoint
    from tinkerless.wire.runs import CheckpointPolicy

    ref = parse_checkpoint(spec)
    if ref.is_base:
        return TrainingClient(backend, BASE_POLICY, create=False)
    check_base_model(find_run(host, ref.run_id), model, f"teacher {spec}")
    client = TrainingClient(backend, TEACHER_POLICY, create=False, namespace=namespace)
    policy = CheckpointPolicy("default", "", client.remote(TEACHER_POLICY), 0)
    try:
        restored = host.checkpoints(ref.run_id).restore([policy], [], ref.step, driver=False)
    except UserError:
        raise
    except TinkerlessError as exc:
        raise UserError(f"teacher {spec}: cannot load that checkpoint: {exc.message}",
                        hint=f"use '{ref.run_id}@latest' or a step `tinkerless runs` lists a checkpoint for") from None
    if restored.step is None:
        raise UserError(f"teacher {spec}: run {ref.run_id!r} has no valid checkpoint",
                        hint="let that run reach its first checkpoint, or name another teacher")
    return client


def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    from tinkerless.functions.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


def _second_model(spec: str, model: str, backend: Any, usage: Any) -> Teacher:
    """Another model as the teacher: a model the server holds beside the policy's, a Forward class of its own on
    Modal, or a second worker on this machine; its seconds metered as the teacher's."""
    from tinkerless.sdk.backends.base import LocalBackend
    from tinkerless.sdk.backends.client import TrainingClient

    http = _http_of(backend)
    if http is not None:
        from tinkerless.sdk.backends.served_model import ServedModelBackend, fetch_tokenizer, served_models

        teacher_backend: Any = ServedModelBackend(http, spec)  # refused here when the server does not hold it
        student_tokenizer = fetch_tokenizer(http, served_models(http)["main"])
        teacher_tokenizer = teacher_backend.teacher_tokenizer
        description = f"model {spec} (served beside the policy by {http.base_url})"
    elif callable(getattr(backend, "served_model", None)):  # Modal: a Forward class holding the teacher's model
        teacher_backend = backend.served_model(spec)
        student_tokenizer, teacher_tokenizer = backend.tokenizer(), teacher_backend.tokenizer()
        description = f"model {spec} (in a Forward class of its own on {backend.name})"
    elif getattr(backend, "name", None) == "local":
        # The same CPU threads as the policy's worker: the two take turns, they never run at once.
        teacher_backend = LocalBackend(spec, threads=backend.worker.threads.threads)
        student_tokenizer = backend.worker.tokenizer
        teacher_tokenizer = teacher_backend.worker.tokenizer
        description = f"model {spec} (a second model on this machine)"
    else:
        raise ConfigError(
            f"teacher={spec!r} is another base model, which runs beside the policy on the local backend, on a "
            f"`tinkerless serve` server that holds it (--also-model) or on Modal, not on {getattr(backend, 'name', backend)!r}",
            hint="use a checkpoint of the same base (RUN@STEP), the base itself, or an OpenAI-compatible endpoint "
            "serving the teacher (teacher='http://host:port/v1')",
        )
    usage.add_meter("teacher", teacher_backend.usage)
    client = TrainingClient(teacher_backend, BASE_POLICY, create=False)
    if _same_vocabulary(student_tokenizer, teacher_tokenizer):
        teacher: Teacher = ForwardTeacher(client, description)
    else:
        teacher = AligningTeacher(lambda data: client.forward(data).logprobs, student_tokenizer, teacher_tokenizer,
                                  description)
    return teacher  # the second worker holds no processes of its own: it goes with the run


def check_teacher_held(config: Any, backend: Any) -> None:
    """A teacher of another base that the run's server does not hold is refused before the run exists, naming the
    models the server holds."""
    from tinkerless.sdk.checkpoints.checkpoint_ref import same_model

    spec = config.teacher.strip() if isinstance(config.teacher, str) else None
    http = _http_of(backend)
    if spec and http is not None and teacher_kind(spec) == "model" and not same_model(spec, config.model):
        from tinkerless.sdk.backends.served_model import served_models

        served_models(http, spec)


def _http_of(backend: Any) -> Any:
    """The `HTTPBackend` a run's calls go through (a server's, a SkyPilot cluster's server's), or None."""
    http = backend if getattr(backend, "name", None) == "http" else getattr(backend, "http", None)
    return http if http is not None and hasattr(http, "post") and hasattr(http, "get") else None


def _same_vocabulary(a: Any, b: Any) -> bool:
    """Whether two tokenizers give the same ids for the same text (then alignment is token for token)."""
    return a.get_vocab() == b.get_vocab()


def opd_advantages(sampler_logprobs: np.ndarray, mask: np.ndarray, scores: SequenceScores, coef: float,
                   reward_advantage: float) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, mask) of one sequence: the teacher's per-token term plus the reward's, on aligned tokens only."""
    trained = (np.asarray(mask) > 0) & (scores.aligned > 0)
    teacher_term = coef * (scores.logprobs.astype(np.float64) - np.asarray(sampler_logprobs, dtype=np.float64))
    advantages = np.where(trained, teacher_term + reward_advantage, 0.0).astype(np.float32)
    return advantages, trained.astype(np.float32)


def teacher_columns(episodes: list[Episode], scores: list[list[SequenceScores]]) -> dict[str, float]:
    """The step's teacher metrics: the log-prob gap (sampler - teacher, the reverse-KL estimate) over aligned
    tokens, the share of sampled tokens aligned, and how many the teacher scored."""
    gap, aligned, sampled = 0.0, 0.0, 0.0
    for episode, per_sequence in zip(episodes, scores):
        for sequence, score in zip(episode.sequences(), per_sequence):
            on = (sequence.mask > 0) & (score.aligned > 0)
            sampled += float((sequence.mask > 0).sum())
            aligned += float(on.sum())
            gap += float((sequence.sampler_logprobs[on].astype(np.float64) - score.logprobs[on]).sum())
    return {
        "teacher_logprob_gap": gap / aligned if aligned else math.nan,
        "teacher_aligned_share": aligned / sampled if sampled else math.nan,
        "teacher_aligned_tokens": aligned,
    }


def topk_batch(episodes: list[Episode], teacher: Teacher, k: int) -> tuple[list[Datum], dict[str, float]]:
    """`topk_forward_kl`'s data: every sampled sequence with the teacher's top-k rows as targets, and the step's
    teacher columns (the same forward gives the teacher's log-probs of the sampled tokens)."""
    if not isinstance(teacher, ForwardTeacher):
        raise ConfigError("distill_loss='topk_forward_kl' needs a teacher on the policy's worker with its tokenizer")
    sequences = [s for e in episodes for s in e.sequences() if s.mask.sum() > 0]
    data = [Datum(tokens=s.tokens, mask=s.mask, sampler_logprobs=s.sampler_logprobs) for s in sequences]
    if not data:
        return [], {}
    result = teacher.client.forward(data, topk=k)
    gap, sampled = 0.0, 0.0
    for datum, lp, ids, lps in zip(data, result.logprobs, result.topk_ids, result.topk_logprobs):
        datum.target_topk_ids, datum.target_topk_logprobs = ids, lps
        on = datum.mask > 0
        gap += float((datum.sampler_logprobs[on].astype(np.float64) - np.asarray(lp)[on]).sum())
        sampled += float(on.sum())
    return data, {"teacher_logprob_gap": gap / sampled, "teacher_aligned_share": 1.0, "teacher_aligned_tokens": sampled}
