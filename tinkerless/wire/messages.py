"""Wire types: the plain-data requests and replies of the rollout, forward and update functions.

Per-token arrays in a `Datum` are aligned with `tokens`: entry i describes
token i as a prediction target (entry 0 is never trained, it has no prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinkerless.wire.code import CodeBlob
from tinkerless.wire.content import VisionInput

BASE_POLICY = "base"  # the base model with every adapter switched off, on every worker


# A temperature under this samples greedily, in every API and engine: dividing logits by a temperature near
# zero overflows them to inf (NaN probabilities), and the draw there is the argmax anyway.
GREEDY_BELOW = 1e-4


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 (or anything under GREEDY_BELOW): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: list[int] | None = None  # None = the model's end-of-turn tokens; [] = never stop early


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    seed: int = 0
    # A vision-language model's parts that train beside its language model (LoRA on their linear layers):
    # "none" (the tower and the connector stay frozen), "connector" (the projector too), "tower" (both).
    vision: str = "none"


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


@dataclass
class EpisodeLimits:
    max_turns: int = 1
    max_episode_tokens: int = 1024


@dataclass
class CreatePolicyRequest:
    policy: str
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DeletePolicyRequest:
    """Free a policy's adapter and optimizer on the worker (its checkpoints in storage stay)."""

    policy: str


@dataclass
class ResetPolicyRequest:
    """Put an existing policy back to its fresh init: the adapter its LoRA seed gives, a new optimizer, version 0.

    With `missing_ok`, a policy the worker does not hold is left alone (it holds nothing stale; its
    `create_policy` will make the fresh init), instead of being an error."""

    policy: str
    missing_ok: bool = False


@dataclass
class JudgeSpec:
    """An LLM judge as a reward (`tinkerless.judge`; `functions/companions/judge.py` runs it beside the rollout)."""

    rubric: str
    mode: str = "pointwise"  # pointwise: each episode alone | group: a task's group ranked together (RULER-style)
    model: str | None = None  # the judge model: None, the policy's base model; at an endpoint, the model's name there
    endpoint: str | None = None  # an OpenAI-compatible base URL (http://host:port/v1); None: the policy's worker
    weight: float = 1.0  # the reward is weight * score, the score in [0, 1]
    timeout: float = 60.0  # seconds for one endpoint call; past them the episode is an infrastructure failure
    retries: int = 2  # an unparseable endpoint reply is asked again this many times, then the episode is marked
    max_tokens: int = 16  # the endpoint judge's reply length


@dataclass
class RolloutRequest:
    policy: str
    tasks: list[dict]
    group_size: int
    sampling: SamplingParams
    limits: EpisodeLimits
    seed: int
    env: CodeBlob | None = None
    reward: CodeBlob | None = None
    system_prompt: str | None = None
    agent: CodeBlob | None = None  # an @tinkerless.agent function: runs instead of the env/reward loop
    agent_timeout: float = 300.0  # seconds one agent copy may run before it is dropped as an error
    agent_transport: str = "asgi"  # asgi: in-process transport to the endpoint | http: loopback HTTP
    judge: JudgeSpec | None = None  # an LLM judge whose weighted score is added to each episode's reward


@dataclass
class TrainingSequence:
    """One more trained token sequence of an episode (see `Episode.extra_sequences`)."""

    tokens: np.ndarray  # int32 [N]
    mask: np.ndarray  # float32 [N]: 1 on sampled tokens
    sampler_logprobs: np.ndarray  # float32 [N]: 0 where mask is 0
    images: list[VisionInput] = field(default_factory=list)  # processed images, in the order of their tokens
    sampled_versions: np.ndarray | None = None  # int32 [N]: the policy version that sampled each token; -1: not sampled


@dataclass
class Episode:
    task_index: int
    tokens: np.ndarray  # int32 [N]: prompt, sampled turns and observations
    mask: np.ndarray  # float32 [N]: 1 on sampled tokens
    sampler_logprobs: np.ndarray  # float32 [N]: 0 where mask is 0
    prompt_length: int
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    num_turns: int = 0
    status: str = "ok"  # ok | truncated | error | infra_failed (see `infra_cause`)
    error: str | None = None
    traceback: str | None = None
    transcript: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    # An agent that rewrote its context: its later calls are sequences of their own, trained with this
    # episode's advantage (the first sequence is tokens/mask/sampler_logprobs above).
    extra_sequences: list[TrainingSequence] = field(default_factory=list)
    # A vision-language episode's images, processed, in the order their image tokens appear in `tokens`.
    images: list[VisionInput] = field(default_factory=list)
    # status "infra_failed": why (errors.InfrastructureFailure.cause). Such an episode is never a reward: it is
    # retried, then dropped from its group (docs/errors.md).
    infra_cause: str | None = None

    # int32 [N]: the policy version that sampled each token of the first sequence (-1 where mask is 0); None from a
    # sampler that does not say (the update then cannot check the tokens' staleness)
    sampled_versions: np.ndarray | None = None


    def sequences(self) -> list[TrainingSequence]:
        """Every trained sequence of the episode: the first (tokens/mask/sampler_logprobs), then the extra ones."""
        first = TrainingSequence(self.tokens, self.mask, self.sampler_logprobs, self.images, self.sampled_versions)
        return [first, *self.extra_sequences]

    def sampled_tokens(self) -> int:
        """Tokens the policy sampled in this episode, over all its sequences (mask == 1)."""
        return int(sum(float(np.asarray(s.mask).sum()) for s in self.sequences()))


@dataclass
class RolloutResult:
    episodes: list[Episode]
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Datum:
    tokens: np.ndarray  # int32 [N]
    mask: np.ndarray  # float32 [N]
    advantages: np.ndarray | None = None  # float32 [N]
    sampler_logprobs: np.ndarray | None = None  # float32 [N]
    old_logprobs: np.ndarray | None = None  # float32 [N], trainer log-probs of the sampling policy (TIS)
    ref_logprobs: np.ndarray | None = None  # float32 [N], base model log-probs (KL)
    images: list[VisionInput] | None = None  # processed images, in the order of their image tokens in `tokens`
    # A teacher's top-k next-token distribution at each position (the `topk_forward_kl` loss): row i holds the
    # k most likely ids for token i given tokens < i and their log-probs (row 0 unused).
    target_topk_ids: np.ndarray | None = None  # int32 [N, k]
    target_topk_logprobs: np.ndarray | None = None  # float32 [N, k]
    sampled_versions: np.ndarray | None = None  # int32 [N], the policy version that sampled each token (-1: none)


@dataclass
class ForwardRequest:
    policy: str
    data: list[Datum]
    with_reference: bool = False
    topk: int = 0  # also the k most likely next tokens at each position and their log-probs (a distillation teacher)


@dataclass
class ForwardResult:
    logprobs: list[np.ndarray]
    ref_logprobs: list[np.ndarray] | None = None
    topk_ids: list[np.ndarray] | None = None  # int32 [N, k] per datum, with topk
    topk_logprobs: list[np.ndarray] | None = None  # float32 [N, k] per datum, with topk


@dataclass
class ForwardBackwardRequest:
    policy: str
    data: list[Datum]
    loss: Any  # tinkerless.functions.losses.LossConfig


@dataclass
class ForwardBackwardResult:
    metrics: dict[str, float]
    logprobs: list[np.ndarray] = field(default_factory=list)


@dataclass
class OptimStepRequest:
    policy: str
    adam: AdamParams = field(default_factory=AdamParams)


@dataclass
class OptimStepResult:
    metrics: dict[str, float]
    policy_version: int


@dataclass
class UpdateRequest:
    """forward_backward followed by optim_step, in one round trip."""

    policy: str
    data: list[Datum]
    loss: Any
    adam: AdamParams = field(default_factory=AdamParams)
    # With the data's sampled_versions: every trained token sampled at most this many versions before the policy's
    # current one (the async pipeline's bound, checked per token before the update); None: not checked
    max_staleness: int | None = None


@dataclass
class UpdateResult:
    metrics: dict[str, float]
    policy_version: int


@dataclass
class SampleRequest:
    policy: str
    prompts: list[list[int] | str]  # token ids, or a string sent as one user message
    num_samples: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    text: str
    stop_reason: str  # stop | length


@dataclass
class SampleResult:
    sequences: list[list[SampledSequence]]  # [prompt][sample]


@dataclass
class PolicyState:
    """A policy's adapter (PEFT files), optimizer and RNG state, as named files."""

    policy: str
    files: dict[str, bytes]
    policy_version: int = 0


@dataclass
class SaveStateRequest:
    policy: str
    include_optimizer: bool = True


@dataclass
class LoadStateRequest:
    state: PolicyState
    include_optimizer: bool = True


@dataclass
class ErrorReply:
    error: str
    category: str  # user | server
    type: str
    traceback: str = ""
    hint: str | None = None
    cause: str | None = None  # an InfrastructureFailure's cause tag (errors.infra_cause), so it is rebuilt with it


@dataclass
class Seat:
    """Who plays a role in a multi-agent env: a policy (trained or frozen) or a scripted opponent."""

    policy: str | None = None  # a policy on the worker ("base" = the base model)
    opponent: CodeBlob | None = None  # opponent(env, role, rng) -> action text
    trainable: bool = True


@dataclass
class MultiAgentRolloutRequest:
    tasks: list[dict]
    group_size: int  # games per task
    env: CodeBlob
    seats: dict[str, Seat]  # role -> seat
    sampling: SamplingParams
    limits: EpisodeLimits  # max_turns counts one role's turns; max_episode_tokens bounds one role's context
    seed: int
    protocol_timeout: float = 300.0  # seconds for the whole batch of games
