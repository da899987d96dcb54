"""Per-request limits on the work one call may ask a server for (docs/serving-limits.md).

Every API that generates checks these before its call is queued: the Tinker `asample`,
`/v1/call/sample`, and rollouts (`/v1/call/rollout`, `/v1/call/rollout_multi`). A request
over a limit gets a 400 of category "user" that names the limit, the value asked for and
the `tinkerless serve` flag that raises it. Slicing (see `scheduler`) keeps a large request
from blocking other tenants; these limits keep any one request's memory and time bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from tinkerless.errors import ConfigError, UserError
from tinkerless.wire.messages import MultiAgentRolloutRequest, RolloutRequest, SampleRequest


class LimitExceeded(UserError):
    """A request asks for more work than this server allows per request."""


@dataclass(frozen=True)
class ServingLimits:
    max_tokens: int = 4096  # tokens one sample (or one turn of an episode) may generate
    max_samples: int = 64  # sequences one sample request may generate (prompts x num_samples)
    max_prompt_tokens: int = 8192  # tokens of one prompt; also bounds an episode's context with max_tokens
    max_group_size: int = 64  # a rollout's group_size (episodes or games per task)
    max_rollouts: int = 512  # episodes (or games) one rollout request may run: tasks x group_size
    # LoRA policies (adapter + optimizer, ~60 MB each on SmolLM2 at rank 16) one tenant may hold on the worker:
    # without a bound, one tenant creating policies in a loop would exhaust the memory every tenant shares.
    max_policies_per_tenant: int = 32

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"serving limit {f.name} must be a positive integer, not {value!r}",
                                  hint=f"pass {self.flag(f.name)} 1 or more")

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    def _check(self, name: str, value: int, what: str) -> None:
        limit = getattr(self, name)
        if value > limit:
            raise LimitExceeded(
                f"{what} is {value}, over this server's limit of {limit} ({name})",
                hint=f"split the work into smaller requests, or start `tinkerless serve` with a larger {self.flag(name)}",
            )

    def check_policies(self, held: int) -> None:
        """Refuse a tenant's new policy when it already holds `max_policies_per_tenant` of them."""
        if held >= self.max_policies_per_tenant:
            raise LimitExceeded(
                f"you hold {held} policies on this server, its limit (max_policies_per_tenant); a new one is refused",
                hint="free policies you no longer train (TrainingClient.delete(), or the `delete_policy` call; "
                f"their checkpoints stay), or start `tinkerless serve` with a larger {self.flag('max_policies_per_tenant')}",
            )

    def check_sample(self, *, samples: int, max_tokens: int, prompt_tokens: int) -> None:
        self._check("max_samples", samples, "the number of sequences to sample")
        self._check("max_tokens", max_tokens, "max_tokens")
        self._check("max_prompt_tokens", prompt_tokens, "the prompt length in tokens")

    def check_rollout(self, *, tasks: int, group_size: int, max_tokens: int, max_episode_tokens: int) -> None:
        self._check("max_group_size", group_size, "group_size")
        self._check("max_rollouts", tasks * max(group_size, 0), "tasks x group_size")
        self._check("max_tokens", max_tokens, "sampling.max_tokens")
        if max_episode_tokens > self.max_prompt_tokens + self.max_tokens:
            raise LimitExceeded(
                f"limits.max_episode_tokens is {max_episode_tokens}, over this server's limit of "
                f"{self.max_prompt_tokens + self.max_tokens} (max_prompt_tokens + max_tokens)",
                hint="lower max_episode_tokens, or start `tinkerless serve` with larger --max-prompt-tokens/--max-tokens",
            )

    def check_call(self, method: str, request: object, count_prompt: Callable[[str], int]) -> None:
        """Check one /v1/call request (decoded); `count_prompt(text)` gives a string prompt's token count
        (as the worker will template it). Tokenizing can take a while: call this off the event loop."""
        if method == "sample" and isinstance(request, SampleRequest):
            self.check_sample(
                samples=len(request.prompts) * max(request.num_samples, 0),
                max_tokens=request.sampling.max_tokens,
                prompt_tokens=0,
            )
            for prompt in request.prompts:
                length = count_prompt(prompt) if isinstance(prompt, str) else len(prompt)
                self._check("max_prompt_tokens", length, "the prompt length in tokens")
        elif isinstance(request, (RolloutRequest, MultiAgentRolloutRequest)) and method in ("rollout", "rollout_multi"):
            self.check_rollout(
                tasks=len(request.tasks), group_size=request.group_size,
                max_tokens=request.sampling.max_tokens, max_episode_tokens=request.limits.max_episode_tokens,
            )

