"""Run configuration: one dataclass, validated before anything expensive starts."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable

from tinkerless.functions.precision import check_dtype
from tinkerless.errors import ConfigError
from tinkerless.functions.losses import LOSS_NAMES, LossConfig
from tinkerless.envs.base import is_multi_agent
from tinkerless.sdk.run.accounting import PriceTable
from tinkerless.sdk.run.run_budget import check_limit
from tinkerless.sdk.run.advantages import AdvantageConfig
from tinkerless.sdk.run.agents import check_roles, seatings, trainable_policies
from tinkerless.sdk.run.distillation import check_teacher
from tinkerless.sdk.run.judging import split_reward
from tinkerless.sdk.tracking.base import check_report_to
from tinkerless.wire.messages import EpisodeLimits, SamplingParams

# algo -> (advantage estimator, default loss normalization)
ALGORITHMS = {
    "grpo": ("grpo", "sequence"),  # std-normalized advantages, sequence-mean of token-means
    "dr_grpo": ("dr_grpo", "constant"),  # no std, no length normalization
}
BACKENDS = ("local", "modal", "sky")
# max_turns=None resolves to these: an env is multi-turn unless it ends episodes itself sooner.
DEFAULT_ENV_MAX_TURNS = 16
DEFAULT_SINGLE_TURN_MAX_TURNS = 1


def check_gpus(gpus: Any, backend: Any) -> None:
    """`gpus`: a count of this machine's GPUs, and a setting of the local backend only."""
    if isinstance(gpus, bool) or not isinstance(gpus, numbers.Integral) or not 1 <= gpus <= 64:
        raise ConfigError(f"gpus must be a whole number from 1 to 64, got {gpus!r}",
                          hint="the GPUs of this machine the update trains over, e.g. gpus=4 (docs/scaling.md)")
    if gpus > 1 and backend != "local":
        raise ConfigError(f"gpus is a setting of the local backend, not of backend={backend!r}",
                          hint="Modal: ModalConfig(update=ClassSpec(gpu='H100:4')); SkyPilot: accelerators: H100:4; "
                          "a server: tinkerless serve --gpus 4 (docs/scaling.md)")


def local_backend_options(backend: Any, **chosen: Any) -> dict:
    """What only the local backend takes (threads, reader processes, GPUs), without the settings at their defaults."""
    if backend != "local":
        return {}
    return {name: value for name, value in chosen.items() if value and not (name == "gpus" and value == 1)}


@dataclass
class TrainConfig:
    """Every setting of a run; each field's default and meaning: docs/config.md (`tinkerless config-reference`)."""

    def __new__(cls, *args: Any, **settings: Any) -> "TrainConfig":
        # Runs before the dataclass __init__, so a misspelled field is the same ConfigError
        # (with a "did you mean") in a config file as in train(**settings) and replace().
        check_setting_names(settings)
        return super().__new__(cls)

    # what to train
    model: str = "smollm2"
    env: type | None = None
    reward: Callable | None = None
    tasks: Any = None  # list of dicts | JSONL path | generator(rng) -> dict
    system_prompt: str | None = None
    agent: Callable | None = None  # an @tinkerless.agent function (docs/agents.md): runs instead of env/reward
    agent_timeout: float = 300.0  # seconds one agent copy may run; a slower one is dropped like a failing env
    agent_transport: str = "asgi"  # how agents reach the worker's OpenAI endpoint: asgi (in-process) | http (loopback); on a shared server, the sandbox's channel
    agents: Any = None  # multi-agent envs: role -> policy name | Frozen(...) | opponent fn, or a list of such seatings
    protocol_timeout: float = 600.0  # seconds before a stuck multi-agent protocol or barrier is an error
    name: str = "run"
    init_from: str | None = None  # warm start: "<run_id>@<step>" / "<run_id>@latest" (e.g. an SFT run) or a PEFT adapter dir
    # algorithm
    algo: str = "grpo"
    loss: str = "importance_sampling"
    normalization: str | None = None  # token | sequence | constant; None = the algo's default
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = None  # truncated IS correction for sampler/trainer mismatch
    kl_coef: float = 0.0  # KL to the base model (adapter off)
    # on-policy distillation (docs/distillation.md): base | model id or dir | RUN@STEP | http(s)://endpoint/v1
    teacher: str | None = None
    distill_coef: float = 1.0  # weight of the teacher's per-token term (teacher - sampler log-prob) in the advantage
    distill_loss: str = "reverse_kl"  # reverse_kl: the per-token advantage above | topk_forward_kl: the teacher's top-k as targets
    distill_topk: int = 64  # k of topk_forward_kl (1 to 1024)
    learning_rate: float = 5e-4
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_vision: str = "none"  # a vision-language model's parts trained beside its LM: none | connector | tower
    # batch and sampling
    steps: int = 10
    batch_size: int = 8  # tasks per step
    group_size: int = 4  # episodes per task
    max_tokens: int = 32  # per turn
    temperature: float = 0.7
    top_p: float = 1.0
    max_turns: int | None = None  # None: 16 with an env, 1 for single-turn reward runs (see turn_limit())
    max_episode_tokens: int = 1024
    # run management
    seed: int = 0
    backend: str = "local"
    engine: str = "auto"  # auto | transformers | vllm (auto picks vLLM when it and a GPU are present)
    dtype: str = "auto"  # base weights: auto (bf16 on a GPU that supports it, else fp32) | bf16 | fp32
    threads: int | None = None  # local CPU threads; None: OMP_NUM_THREADS, else free usable cores (docs/threads.md)
    rollout_workers: int = 0  # local backend: sample in this many processes of their own beside the writer (docs/async.md)
    gpus: int = 1  # local backend: train over this many GPUs of this machine as FSDP2 ranks, sampling on the first (docs/scaling.md)
    max_staleness: int = 0  # k: step s samples from policy version max(0, s-k) while earlier updates run; 0: synchronous
    storage: str = "."
    # fsspec options for `storage`, e.g. {"client_kwargs": {"endpoint_url": "https://<acct>.r2.cloudflarestorage.com"}};
    # kept out of the saved run state, since they may hold credentials.
    storage_options: dict | None = None
    run_id: str | None = None
    resume: bool = False
    checkpoint_every: int = 5
    keep_checkpoints: int | None = 3
    on_env_error: str = "skip"  # skip | raise
    reconnect_timeout: float = 300.0  # seconds a run waits for a server that died or restarted before it gives up
    infra_retries: int = 2  # times an episode that failed for an infrastructure reason is played again before it is dropped
    micro_batch_size: int = 16
    progress: bool = True
    transcripts_per_step: int = 4  # whole episodes sampled per step into runs/<id>/episodes.jsonl; 0 = none
    # pay-per-use: device seconds are priced in $/hour; see tinkerless.sdk.run.accounting.DEFAULT_PRICES_PER_HOUR
    prices: dict[str, float] | None = None  # device name -> $/hour, tried before the defaults ("H100": 2.0)
    price_per_hour: float | None = None  # one flat $/hour for whatever device runs the functions
    max_cost_usd: float | None = None  # the run stops (checkpointed, resumable) before a step that would cost more
    max_compute_seconds: float | None = None  # the same limit in device-seconds
    # held-out evaluation while training (docs/eval.md)
    eval_every: int | None = None  # every N steps, from step 0: play eval_tasks with the current policy (no training); None: never
    eval_tasks: Any = None  # held-out tasks for eval_every and `tinkerless eval` (the forms of tasks); episodes per task: group_size
    eval_agents: Any = None  # multi-agent runs: the seating(s) eval_every plays, e.g. each seat against an opponent; None: agents
    # experiment trackers
    report_to: list[str] = dataclasses.field(default_factory=list)  # wandb | tensorboard | mlflow, logged from the client (docs/tracking.md)

    def local_backend_options(self) -> dict:
        return local_backend_options(self.backend, threads=self.threads, rollout_workers=self.rollout_workers, gpus=self.gpus)

    def validate(self) -> None:
        if self.lora_vision not in ("none", "connector", "tower"):
            raise ConfigError(f"lora_vision must be 'none', 'connector' or 'tower', got {self.lora_vision!r}")
        if self.algo not in ALGORITHMS:
            raise ConfigError(f"unknown algo {self.algo!r}", hint=f"one of {', '.join(ALGORITHMS)}")
        if self.loss not in LOSS_NAMES:
            raise ConfigError(f"unknown loss {self.loss!r}", hint=f"one of {', '.join(LOSS_NAMES)}")
        check_dtype(self.dtype)
        if self.on_env_error not in ("skip", "raise"):
            raise ConfigError(f"on_env_error must be 'skip' or 'raise', got {self.on_env_error!r}")
        for name in ("steps", "batch_size", "group_size", "max_tokens", "max_turns", "threads", "checkpoint_every", "lora_rank"):
            value = getattr(self, name)
            if name in ("max_turns", "threads") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"{name} must be an integer (at least 1), got {value!r}")
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        wait = self.reconnect_timeout
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 86400:
            raise ConfigError(f"reconnect_timeout must be a number of seconds from 0 to 86400, got {wait!r}",
                              hint="0: a run through a server fails at once when the server goes away")
        retries = self.infra_retries
        if isinstance(retries, bool) or not isinstance(retries, numbers.Integral) or not 0 <= retries <= 10:
            raise ConfigError(f"infra_retries must be a whole number from 0 to 10, got {retries!r}",
                              hint="how often an episode whose env server, judge or sandbox failed is played again")
        for name, most in (("max_staleness", 64), ("rollout_workers", 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= most:
                raise ConfigError(f"{name} must be a whole number from 0 to {most}, got {value!r}",
                                  hint="see docs/async.md: e.g. max_staleness=1 with rollout_workers=1")
        check_gpus(self.gpus, self.backend)
        if self.rollout_workers and self.backend != "local":
            raise ConfigError(f"rollout_workers is a setting of the local backend, not of backend={self.backend!r}",
                              hint="on Modal the rollout containers are the readers (ModalConfig); drop rollout_workers")
        if isinstance(self.transcripts_per_step, bool) or not isinstance(self.transcripts_per_step, int) or self.transcripts_per_step < 0:
            raise ConfigError(
                f"transcripts_per_step must be a whole number >= 0, got {self.transcripts_per_step!r}",
                hint="e.g. 4 episodes per step into runs/<id>/episodes.jsonl, or 0 for none",
            )
        if self.agent is not None:
            self._validate_agent()
        elif self.env is None and self.reward is None and self.teacher is None:
            raise ConfigError(
                "a run needs an env, a reward, or both (or an agent, or a teacher to distill from)",
                hint="pass env=MyEnv and/or reward=my_reward, agent=my_agent (an @tinkerless.agent function), "
                "or teacher='RUN@STEP' (docs/distillation.md)",
            )
        if self.env is not None and is_multi_agent(self.env):
            if self.agents is None:
                roles = list(getattr(self.env, "agents", ()))
                raise ConfigError(
                    f"{self.env.__qualname__} is a multi-agent env with roles {roles}; say who plays them",
                    hint=f"e.g. agents=tinkerless.self_play({roles}) or agents={{{roles[0]!r}: 'policy', ...: tinkerless.Frozen()}}",
                )
            for seating in seatings(self.agents):
                check_roles(self.env, seating)
            if not trainable_policies(self.agents):
                raise ConfigError("no role is played by a trained policy", hint="give at least one role a policy name")
        elif self.agents is not None:
            raise ConfigError("agents= is only for multi-agent envs (with `agents` and `turn()`)")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from.strip() or self.agents is not None):
            raise ConfigError(
                f"init_from={self.init_from!r}: a warm start takes '<run_id>@<step>' or an adapter directory, for a single-agent run",
                hint="multi-agent runs load adapters with agents={role: tinkerless.Frozen(path)}",
            )
        if self.tasks is None:
            raise ConfigError("a run needs tasks", hint="tasks=[{...}], a JSONL path, or a generator function")
        self._validate_eval()
        if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", self.run_id):
            raise ConfigError(f"invalid run_id {self.run_id!r}", hint="letters, digits, '.', '_' and '-'")
        check_report_to(self.report_to)  # a tracker that is not installed fails here, before any model loads
        check_teacher(self.teacher, self.distill_coef, self.distill_loss, self.distill_topk)
        if self.reward is not None:
            split_reward(self.reward)  # a function, a tinkerless.judge(...), or a list of them
        if self.teacher is not None and self.env is not None and is_multi_agent(self.env):
            raise ConfigError("teacher= is for single-agent runs", hint="distill each policy in a run of its own")
        self.loss_config().validate()
        self.advantage_config().validate()
        self.price_table()
        check_limit("max_cost_usd", self.max_cost_usd)
        check_limit("max_compute_seconds", self.max_compute_seconds)

    def _validate_eval(self) -> None:
        if self.eval_agents is not None:
            if self.env is None or not is_multi_agent(self.env):
                raise ConfigError("eval_agents is for multi-agent envs", hint="a single-agent run evaluates its one policy")
            for seating in seatings(self.eval_agents):
                check_roles(self.env, seating)
            unknown = sorted(set(trainable_policies(self.eval_agents)) - set(trainable_policies(self.agents)))
            if unknown or not trainable_policies(self.eval_agents):
                raise ConfigError(f"eval_agents must seat the run's own policies, and only those: it seats {trainable_policies(self.eval_agents)}",
                                  hint=f"seat the run's policies {trainable_policies(self.agents)}, tinkerless.Frozen(...) or opponent functions")
        if self.eval_every is None:
            return
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, numbers.Integral) or self.eval_every < 1:
            raise ConfigError(f"eval_every must be a whole number of steps (at least 1) or None, got {self.eval_every!r}")
        if self.eval_tasks is None:
            raise ConfigError("eval_every needs held-out tasks to evaluate on",
                              hint="give eval_tasks=[{...}] (or a JSONL path or task function), tasks the run does not train on")

    def _validate_agent(self) -> None:
        if self.env is not None or self.reward is not None:
            raise ConfigError(
                "agent= replaces env= and reward=: the agent function plays the episode and returns its reward",
                hint="pass only agent=my_agent (or drop agent= to train an env/reward)",
            )
        if not getattr(self.agent, "__tinkerless_agent__", False):
            from tinkerless.envs.decorators import agent

            agent(self.agent)  # the same checks (an async function of (client, task)) for an undecorated one
        timeout = self.agent_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ConfigError(f"agent_timeout must be a number of seconds in (0, 86400], got {timeout!r}")
        if self.agent_transport not in ("asgi", "http"):
            raise ConfigError(f"agent_transport must be 'asgi' or 'http', got {self.agent_transport!r}",
                              hint="asgi: in-process (the default); http: a loopback HTTP server on the worker")

    def loss_config(self) -> LossConfig:
        normalization = self.normalization or ALGORITHMS[self.algo][1]
        constant = float(self.max_tokens * self.turn_limit() * self.batch_size * self.group_size)
        return LossConfig(
            name=self.loss,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            normalization=normalization,
            normalization_constant=constant if normalization == "constant" else None,
            tis_cap=self.tis_cap,
            kl_coef=self.kl_coef,
        )

    def turn_limit(self) -> int:
        """max_turns as the episodes use it: the explicit value, or the default for this kind of run."""
        if self.max_turns is not None:
            return self.max_turns
        multi_turn = self.env is not None or self.agent is not None
        return DEFAULT_ENV_MAX_TURNS if multi_turn else DEFAULT_SINGLE_TURN_MAX_TURNS

    def sampling_params(self) -> SamplingParams:
        """How the run's rollouts (and its evals) sample."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p)

    def episode_limits(self) -> EpisodeLimits:
        """Where the run's episodes (and its evals') are cut off."""
        return EpisodeLimits(max_turns=self.turn_limit(), max_episode_tokens=self.max_episode_tokens)

    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(estimator=ALGORITHMS[self.algo][0])

    def price_table(self) -> PriceTable:
        """The prices this run's compute is billed at (ConfigError for a negative or non-numeric price)."""
        if self.prices is not None and not isinstance(self.prices, dict):
            raise ConfigError(
                f"prices must be a dict of device name -> $/hour, got {self.prices!r}", hint="e.g. prices={'H100': 3.95}"
            )
        return PriceTable(self.prices, price_per_hour=self.price_per_hour)

    def replace(self, **changes: Any) -> "TrainConfig":
        check_setting_names(changes)
        return dataclasses.replace(self, **changes)

    def summary(self) -> dict:
        """The plain-data part of the config (user code replaced by its name), for run state."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("env", "reward", "agent", "tasks", "eval_tasks") and value is not None and not isinstance(value, (str, int, float)):
                value = getattr(value, "__qualname__", type(value).__name__)
            if f.name in ("agents", "eval_agents") and value is not None:
                value = repr(value)
            if f.name == "storage_options":
                continue
            out[f.name] = value
        return out


def check_setting_names(settings: dict) -> None:
    """ConfigError naming each unknown TrainConfig setting, with the closest field name when one is close."""
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = [name for name in settings if name not in fields]
    if not unknown:
        return
    guesses = []
    for name in unknown:
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
        guesses.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise ConfigError(
        f"unknown TrainConfig setting{'s' if len(unknown) > 1 else ''}: {', '.join(guesses)}",
        hint="every setting with its default and meaning: docs/config.md, or `tinkerless config-reference`",
    )
