"""Old module paths, kept importable after the move into subpackages (docs/architecture.md).

Module paths are baked into things that outlive a release: users' imports, pickles of their code (cloudpickle
refers to importable modules by name), a Modal image built earlier. `install()` puts a finder on `sys.meta_path`
that answers an old path with the module that now lives at the new one, the same module object, so
`tinkerless.sdk.trainer.train is tinkerless.sdk.run.trainer.train`. (`tinkerless.sdk.cli`, `.sft`, `.backends` and
`tinkerless.functions.training` were modules and are packages now: they re-export what the modules offered.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "tinkerless.server.body": "tinkerless.wire.http",
    "tinkerless.functions.engine": "tinkerless.functions.sampling.engine",
    "tinkerless.functions.batcher": "tinkerless.functions.sampling.batcher",
    "tinkerless.functions.kv_cache": "tinkerless.functions.sampling.kv_cache",
    "tinkerless.functions.gqa_attention": "tinkerless.functions.sampling.gqa_attention",
    "tinkerless.functions.lora_inference": "tinkerless.functions.sampling.lora_inference",
    "tinkerless.functions.slicing": "tinkerless.functions.sampling.slicing",
    "tinkerless.functions.token_stream": "tinkerless.functions.sampling.token_stream",
    "tinkerless.functions.vllm_engine": "tinkerless.functions.sampling.vllm_engine",
    "tinkerless.functions.micro_batches": "tinkerless.functions.training.micro_batches",
    "tinkerless.functions.policy_state": "tinkerless.functions.training.policy_state",
    "tinkerless.functions.shared_prefix": "tinkerless.functions.training.shared_prefix",
    "tinkerless.functions.agent_loop": "tinkerless.functions.rollout.agent_loop",
    "tinkerless.functions.multi_agent_loop": "tinkerless.functions.rollout.multi_agent_loop",
    "tinkerless.functions.recording": "tinkerless.functions.rollout.recording",
    "tinkerless.functions.rollout_clock": "tinkerless.functions.rollout.rollout_clock",
    "tinkerless.functions.chat": "tinkerless.functions.rollout.chat",
    "tinkerless.functions.user_code": "tinkerless.functions.hosting.user_code",
    "tinkerless.functions.user_code_host": "tinkerless.functions.hosting.user_code_host",
    "tinkerless.functions.user_code_protocol": "tinkerless.functions.hosting.user_code_protocol",
    "tinkerless.functions.agent_channel": "tinkerless.functions.hosting.agent_channel",
    "tinkerless.functions.agent_channel_server": "tinkerless.functions.hosting.agent_channel_server",
    "tinkerless.functions.agent_host": "tinkerless.functions.hosting.agent_host",
    "tinkerless.functions.hosted_agents": "tinkerless.functions.hosting.hosted_agents",
    "tinkerless.functions.agent_functions": "tinkerless.functions.hosting.agent_functions",
    "tinkerless.server.openai_api.backend": "tinkerless.functions.openai_api.backend",
    "tinkerless.server.openai_api.render": "tinkerless.functions.openai_api.render",
    "tinkerless.server.openai_api.router": "tinkerless.functions.openai_api.router",
    "tinkerless.server.openai_api.schemas": "tinkerless.functions.openai_api.schemas",
    "tinkerless.server.openai_api.streaming": "tinkerless.functions.openai_api.streaming",
    "tinkerless.server.openai_api.output": "tinkerless.functions.openai_api.output",
    "tinkerless.server.openai_api.replies": "tinkerless.functions.openai_api.replies",
    "tinkerless.sdk.trainer": "tinkerless.sdk.run.trainer",
    "tinkerless.sdk.tasks": "tinkerless.sdk.run.tasks",
    "tinkerless.sdk.advantages": "tinkerless.sdk.run.advantages",
    "tinkerless.sdk.metrics": "tinkerless.sdk.run.metrics",
    "tinkerless.sdk.step_metrics": "tinkerless.sdk.run.step_metrics",
    "tinkerless.sdk.lifecycle": "tinkerless.sdk.run.lifecycle",
    "tinkerless.sdk.truncation": "tinkerless.sdk.run.truncation",
    "tinkerless.sdk.transcripts": "tinkerless.sdk.run.transcripts",
    "tinkerless.sdk.progress": "tinkerless.sdk.run.progress",
    "tinkerless.sdk.accounting": "tinkerless.sdk.run.accounting",
    "tinkerless.sdk.agents": "tinkerless.sdk.run.agents",
    "tinkerless.sdk.multi_agent": "tinkerless.sdk.run.multi_agent",
    "tinkerless.sdk.cli_eval": "tinkerless.sdk.cli.evaluate",
    "tinkerless.sdk.cli_export": "tinkerless.sdk.cli.export",
    "tinkerless.sdk.cli_sft": "tinkerless.sdk.cli.sft",
    "tinkerless.sdk.sft_config": "tinkerless.sdk.sft.config",
    "tinkerless.sdk.sft_data": "tinkerless.sdk.sft.data",
    "tinkerless.sdk.sft_plot": "tinkerless.sdk.sft.plot",
    "tinkerless.sdk.evaluate": "tinkerless.sdk.evaluation.evaluate",
    "tinkerless.sdk.agent_eval": "tinkerless.sdk.evaluation.agent_eval",
    "tinkerless.sdk.pass_at_k": "tinkerless.sdk.evaluation.pass_at_k",
    "tinkerless.sdk.http_backend": "tinkerless.sdk.backends.http",
    "tinkerless.sdk.client": "tinkerless.sdk.backends.client",
    "tinkerless.sdk.server_runs": "tinkerless.sdk.backends.server_runs",
    "tinkerless.sdk.run_host": "tinkerless.sdk.backends.run_host",
    "tinkerless.sdk.checkpoint_ref": "tinkerless.sdk.checkpoints.checkpoint_ref",
    "tinkerless.sdk.warm_start": "tinkerless.sdk.checkpoints.warm_start",
    "tinkerless.sdk.export": "tinkerless.sdk.checkpoints.export",
    "tinkerless.sdk.decorators": "tinkerless.envs.decorators",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])  # registered under the old name too, by the import system

    def exec_module(self, module) -> None:
        pass  # already executed, under its new name


def install() -> None:
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
