"""tinkerless: RL-train LLM agents from plain Python, locally or on rented GPUs.

    import tinkerless

    @tinkerless.reward
    def exact(completion: str, task: dict) -> float: ...

    tinkerless.train(model="smollm2", reward=exact, tasks=[...], steps=20)

Public API:
- `env`, `reward`: decorators for user environments and reward functions; `judge`: an LLM judge as a reward;
- `agent`, `AgentResult`: an async OpenAI-client agent function, trained as it is (docs/agents.md);
  `anthropic_client(client)`: an Anthropic client on the same episode (docs/anthropic-messages.md);
  `external_agent(command)`: an agent in another process or language, through the capture endpoint;
- `StepResult`: what an env's `step()` returns;
- `train`, `TrainConfig`, `RunResult`: run RL end to end;
- `sft`, `SFTConfig`: supervised fine-tuning on chat data (docs/sft.md);
- `evaluate`, `export`: a checkpoint's reward and pass@k, or its adapter/merged weights as files (docs/eval.md);
- `MultiStepResult`, `Frozen`, `self_play`, `versus`, `round_robin`: multi-agent envs and who plays them;
- `tool`, `ToolEnv`: tool-calling envs;
- `TrainingClient`, `LocalBackend`: Tinker-style primitives (sample, forward_backward, optim_step, save/load_state);
- `LossConfig`, `AdamParams`, `SamplingParams`, `LoraConfig`, `Datum`: wire types;
- `TextPart`, `ImagePart`, `image_part`: content parts, images in tasks, observations and messages (docs/vision.md);
- `errors`: the typed exceptions.
Heavy modules (torch, transformers) load on first use of what needs them.
"""

from __future__ import annotations

import importlib
from typing import Any

from tinkerless import _moved, errors
from tinkerless.envs.base import StepResult
from tinkerless.envs.decorators import AgentResult, agent, env, reward

__version__ = "0.1.0"

_moved.install()  # module paths from before the move into subpackages stay importable

_LAZY = {
    "train": "tinkerless.sdk.run.trainer",
    "RunResult": "tinkerless.sdk.run.trainer",
    "TrainConfig": "tinkerless.sdk.config",
    "sft": "tinkerless.sdk.sft.loop",
    "SFTConfig": "tinkerless.sdk.sft.config",
    "evaluate": "tinkerless.sdk.evaluation.evaluate",
    "export": "tinkerless.sdk.checkpoints.export",
    "TrainingClient": "tinkerless.sdk.backends.client",
    "LocalBackend": "tinkerless.sdk.backends.base",
    "LossConfig": "tinkerless.functions.losses",
    "AdamParams": "tinkerless.wire.messages",
    "SamplingParams": "tinkerless.wire.messages",
    "LoraConfig": "tinkerless.wire.messages",
    "Datum": "tinkerless.wire.messages",
    "anthropic_client": "tinkerless.functions.hosting.clients",
    "external_agent": "tinkerless.functions.hosting.external_agents",
    "Frozen": "tinkerless.sdk.run.agents",
    "self_play": "tinkerless.sdk.run.agents",
    "versus": "tinkerless.sdk.run.agents",
    "round_robin": "tinkerless.sdk.run.agents",
    "judge": "tinkerless.sdk.run.judging",
    "MultiStepResult": "tinkerless.envs.base",
    "tool": "tinkerless.envs.tools",
    "ToolEnv": "tinkerless.envs.tools",
    "TextPart": "tinkerless.wire.content",
    "ImagePart": "tinkerless.wire.content",
    "image_part": "tinkerless.wire.content",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tinkerless' has no attribute {name!r}")


__all__ = ["AgentResult", "StepResult", "agent", "env", "errors", "reward", *_LAZY]
