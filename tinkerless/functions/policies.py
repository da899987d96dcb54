"""The policies on the worker's one base model: a LoRA adapter and an AdamW optimizer each, and which one is live.

peft keeps every adapter inside one model and switches between them in place, so the model is stateful: the
first policy wraps the base model in a PeftModel, every later one adds an adapter to it, and each forward pass
runs with whichever adapters were set last. `PolicyAdapters` owns that state (the model object, the policies,
the adapter that is live, the vLLM engine's adapter directories) so that nothing else calls peft to add, drop or
switch adapters. The wire functions and their checks (names, the tenant's policy quota, a policy still
sampling) stay in `worker`, which calls these methods.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tinkerless.errors import ConfigError, UserError
from tinkerless.functions.sampling import lora_inference
from tinkerless.functions.training.policy_state import peft_config, reinit_adapter
from tinkerless.wire.messages import BASE_POLICY, LoraConfig


@dataclass
class Policy:
    lora: LoraConfig
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    version: int = 0


class PolicyAdapters:
    def __init__(self, base_model: Any):
        self.base_model = base_model
        self.model: Any = base_model  # becomes a PeftModel with the first policy
        self.policies: dict[str, Policy] = {}
        # The adapter state the model is in, so that switching to the state it is in already costs nothing
        # (peft's set_adapter and disable_adapter walk every module: 15-65 ms on SmolLM2, once per decode step).
        # A policy's name: its adapter active and every adapter enabled; BASE_POLICY: every adapter disabled;
        # None: unknown (peft added, deleted or re-set adapters), the next switch is made in full.
        self._adapter_state: str | None = None
        self._snapshot_root = tempfile.mkdtemp(prefix="tinkerless-adapters-")
        # A vision-language model's LoRA targets: 'all-linear' would reach the vision tower, so a VLM worker sets
        # this to put a config's adapters where it asks (`vision.models.lora_targets`).
        self.resolve_lora: Callable[[LoraConfig], LoraConfig] = lambda lora: lora

    def get(self, name: str) -> Policy:
        if name not in self.policies:
            raise UserError(
                f"policy {name!r} does not exist on this worker",
                hint="call create_policy first (the client does this when a run starts)",
            )
        return self.policies[name]

    # ---- adding, re-initializing, dropping -------------------------------------
    def add(self, name: str, lora: LoraConfig, on_wrap: Callable[[Any], None]) -> None:
        """A new adapter `name` from `lora` (the caller has checked the name). The first one wraps the base
        model in a PeftModel: `on_wrap` gets it before anything samples from the new policy."""
        from peft import get_peft_model

        config = peft_config(self.resolve_lora(lora))
        self._adapters_changed()
        try:
            # Seed LoRA's random init so the same seed gives the same adapter.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(lora.seed)
                if not self.policies:
                    model = get_peft_model(self.base_model, config, adapter_name=name)
                else:
                    self.model.add_adapter(name, config)
                    model = self.model
        except ValueError as exc:  # peft's refusals (no such target module, ...) are the caller's config
            if self.policies:  # peft registers the config before injecting: forget it, or a retry finds it taken
                getattr(self.model, "peft_config", {}).pop(name, None)
            raise ConfigError(
                f"cannot create LoRA adapter {name!r}: {str(exc)[:300]}",
                hint="target_modules must name linear layers of this model (or be 'all-linear')",
            ) from None
        if model is not self.model:
            self.model = model
            on_wrap(self.model)
        lora_inference.install(self.model)  # the new adapter may have wrapped layers no earlier one did
        params = [p for n, p in self.model.named_parameters() if "lora_" in n and f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        self.policies[name] = Policy(lora=lora, params=params, optimizer=optimizer)
        self.model.eval()  # no dropout anywhere: training and sampling see the same function

    def reset(self, name: str) -> None:
        """The adapter's init from its LoRA seed again, a fresh optimizer, version 0."""
        policy = self.get(name)
        self._adapters_changed()
        reinit_adapter(self.model, name, self.resolve_lora(policy.lora))
        policy.optimizer = torch.optim.AdamW(policy.params, lr=1e-4)
        policy.version = 0
        self.forget_snapshots(name)

    def drop(self, name: str) -> bool:
        """Free a policy's adapter and optimizer. False if absent."""
        if name not in self.policies:
            return False
        if len(self.policies) == 1:
            # peft cannot drop a model's last adapter; keep the slot, it is reused or freed with the worker.
            return False
        self._adapters_changed()
        with warnings.catch_warnings():  # peft notes it switched the active adapter: the next call activates its own
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.model.delete_adapter(name)
        lora_inference.forget(self.model, name)  # its layers' views would keep the freed weights alive
        del self.policies[name]
        return True

    # ---- which adapter is live -------------------------------------------------
    def adapter_name(self, policy: str | None) -> str:
        """The peft adapter of `policy` in a batch that mixes policies ("__base__": the base model)."""
        if policy in (None, BASE_POLICY):
            return "__base__"
        self.get(policy)
        return policy

    @contextlib.contextmanager
    def activate(self, policy: str | None):
        """Run the block with `policy`'s adapter (the base model: every adapter disabled). The switch outlasts
        the block, so the next block of the same policy (a generation's next decode step) switches nothing."""
        self._switch_adapter(policy)
        yield

    def _switch_adapter(self, policy: str | None) -> None:
        wanted = BASE_POLICY if policy in (None, BASE_POLICY) else policy
        if wanted != BASE_POLICY:
            self.get(wanted)
        if wanted == self._adapter_state or not self.policies:  # no policy yet: the model is the bare base model
            return
        previous, self._adapter_state = self._adapter_state, None  # unknown until the switch is complete
        if wanted == BASE_POLICY:
            self.model.base_model.disable_adapter_layers()
        else:
            if previous in (None, BASE_POLICY):
                self.model.base_model.enable_adapter_layers()
            self.model.set_adapter(wanted)
            # set_adapter marks only the active adapter trainable; keep every policy's own flags.
            for p in self.policies[wanted].params:
                p.requires_grad_(True)
        self._adapter_state = wanted

    def _adapters_changed(self) -> None:
        """peft added, deleted or re-activated adapters: the model's adapter state is no longer the tracked one."""
        self._adapter_state = None

    # ---- adapter directories for the vLLM engine -------------------------------
    def snapshot(self, policy: str, adapter_files: Callable[[str], dict[str, bytes]]) -> tuple[str, str] | None:
        """The policy's current adapter as a PEFT directory, written once per version from `adapter_files`
        (the policy's saved state: "adapter/<file>" names); vLLM hot-loads adapters from directories."""
        if policy == BASE_POLICY:
            return None
        version = self.get(policy).version
        directory = os.path.join(self._snapshot_root, policy, f"v{version}")
        if not os.path.exists(os.path.join(directory, "adapter_config.json")):
            os.makedirs(directory, exist_ok=True)
            for name, blob in adapter_files(policy).items():
                if name.startswith("adapter/"):
                    with open(os.path.join(directory, name.split("/", 1)[1]), "wb") as f:
                        f.write(blob)
        return directory, str(version)

    def forget_snapshots(self, name: str) -> None:
        # The directories are keyed by version; a reset or load reuses versions.
        shutil.rmtree(os.path.join(self._snapshot_root, name), ignore_errors=True)
