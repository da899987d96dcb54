"""`sft()`: supervised fine-tuning of a LoRA adapter with cross-entropy, on every backend.

It drives the same machinery as `train()`: the backend's `update` function with the
`cross_entropy` loss (per-token weights ride in the datum's mask), the run's coordinator
(each step passes its barrier like an RL step: the batch is the "rollout"), verified
checkpoints in the run's storage or on its server, pay-per-use accounting, metrics.jsonl,
a plot, a progress bar and exact resume after a kill. Data: `tinkerless.sdk.sft.data`.

The data order is a seeded permutation per epoch, so a step's batch follows from the step
alone and a resumed run trains on exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from tinkerless.errors import UserError
from tinkerless.functions.losses import LossConfig
from tinkerless.sdk.run.accounting import RunUsage, format_usage, latest_usage
from tinkerless.sdk.backends.base import Backend, device_of, make_backend, with_usage
from tinkerless.sdk.backends.client import TrainingClient, free_policies
from tinkerless.sdk.run.lifecycle import Heartbeat, heartbeat_interval, interruptible, uninterrupted
from tinkerless.sdk.run.metrics import MetricsWriter, read_metrics
from tinkerless.sdk.run.progress import Progress
from tinkerless.sdk.backends.run_host import run_host_for
from tinkerless.sdk.config import local_backend_options
from tinkerless.sdk.sft.config import SFTConfig
from tinkerless.sdk.sft.data import SFTExample, as_records, render_examples, split_holdout
from tinkerless.sdk.sft.plot import plot_sft
from tinkerless.sdk.run.trainer import CLIENT_STATE_FILE, RunResult
from tinkerless.sdk.checkpoints.warm_start import apply_init_from, check_init_from
from tinkerless.sdk.tracking.runs import finish_run_trackers, open_run_trackers
from tinkerless.wire.messages import AdamParams, Datum, LoraConfig
from tinkerless.wire.runs import CheckpointPolicy

# Token-mean NLL over the batch's trained tokens: every assistant token counts the same.
SFT_LOSS = LossConfig(name="cross_entropy", normalization="token")


def sft(config: SFTConfig | None = None, *, backend: Backend | str | None = None, **settings: Any) -> RunResult:
    """Fine-tune a LoRA adapter on chat data. `sft(model=..., data="train.jsonl", ...)` or `sft(config)`."""
    if config is None:
        config = SFTConfig(**settings)
    elif settings:
        config = config.replace(**settings)
    if isinstance(backend, str):
        config = config.replace(backend=backend)
    config.validate()
    with interruptible():  # SIGTERM stops a run like Ctrl-C: marked interrupted, resumable
        return _SFTRun(config, backend if not isinstance(backend, (str, type(None))) else None).run()


def load_vision(backend: Backend, model: str):
    """A vision-language model's processor (images to pixels and image tokens), or None for a text model."""
    worker = getattr(backend, "worker", None) or getattr(getattr(backend, "inner", None), "worker", None)
    if worker is not None:
        return worker.vision.processor if getattr(worker, "vision", None) is not None else None
    from tinkerless.functions.vision.processing import load_processor

    return load_processor(model)


def load_tokenizer(backend: Backend, model: str):
    """The model's tokenizer and end-of-turn id: the in-process worker's, else loaded here from the model spec."""
    worker = getattr(backend, "worker", None) or getattr(getattr(backend, "inner", None), "worker", None)
    if worker is not None:
        return worker.tokenizer, worker.chat.end_of_turn_id
    from transformers import AutoTokenizer

    from tinkerless.functions.rollout.chat import ChatFormat
    from tinkerless.functions.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    return tokenizer, ChatFormat(tokenizer).end_of_turn_id


def render_data(config: SFTConfig, tokenizer, end_of_turn_id: int | None,
                vision: Any = None) -> tuple[list[SFTExample], list[SFTExample]]:
    """(train, eval) examples; every data error is raised here, before a run exists."""
    from tinkerless.sdk.sft.data import ChatRenderer

    renderer = ChatRenderer(tokenizer, end_of_turn_id, vision)

    def render(data: Any) -> list[SFTExample]:
        source = str(data) if isinstance(data, (str, Path)) else "SFT data"
        return render_examples(as_records(data), renderer, max_length=config.max_length, source=source)

    examples = render(config.data)
    if config.eval_data is not None:
        return examples, render(config.eval_data)
    return split_holdout(examples, config.eval_fraction, config.seed)


def batch_indices(step: int, batch_size: int, count: int, seed: int) -> list[int]:
    """The examples of step `step`: consecutive slices of a seeded permutation per epoch."""
    out, orders = [], {}
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, count)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(count)
        out.append(int(orders[epoch][offset]))
    return out


def datum(example: SFTExample) -> Datum:
    return Datum(tokens=example.tokens, mask=example.weights, images=example.images)


def nll(client: TrainingClient, examples: list[SFTExample]) -> float:
    """Mean negative log-likelihood per trained token, under the current adapter (no gradient)."""
    data = [datum(e) for e in examples]
    logprobs = client.forward(data).logprobs
    total = sum(float(-(lp * e.weights).sum()) for lp, e in zip(logprobs, examples))
    return total / max(sum(e.trained_tokens for e in examples), 1)


class _SFTRun:
    def __init__(self, config: SFTConfig, backend: Backend | None):
        self.config = config
        self.heartbeat_s = heartbeat_interval()
        self.backend = with_usage(
            backend
            or make_backend(config.backend, config.model, engine=config.engine, micro_batch_size=config.micro_batch_size,
                            dtype=config.dtype, **local_backend_options(config.backend, threads=config.threads, gpus=config.gpus))
        )
        try:
            tokenizer, end_of_turn = load_tokenizer(self.backend, config.model)
            self.train_set, self.eval_set = render_data(config, tokenizer, end_of_turn,
                                                        load_vision(self.backend, config.model))
            self.steps = config.steps or math.ceil(config.epochs * len(self.train_set) / config.batch_size)
            self.host = run_host_for(self.backend, config.storage, config.storage_options)
            if config.init_from and not config.resume:  # a wrong source fails before the run exists
                check_init_from(config.init_from, self.host, config.model, config.lora_rank)
            self.coordinator, start = self._open_run()
        except BaseException:
            self.backend.close()
            raise
        self.run_id = self.coordinator.run_id
        self.heartbeat = Heartbeat(self.coordinator, self.heartbeat_s).start()
        self.checkpoints = self.host.checkpoints(self.run_id, config.keep_checkpoints, self.coordinator)
        self.run_dir = self.host.run_dir(self.run_id)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl")
        self.step = 0
        self.version = 0
        self.warm_start = None
        try:
            prior = latest_usage(self.coordinator.state.summary) if start else None
            self.usage = RunUsage(self.backend.usage, config.price_table(), prior=prior)
            with self.usage.phase("setup"):
                self.usage.device = device_of(self.backend)
                self.namespace = "s" + hashlib.sha256(f"{self.host.where}|{self.run_id}".encode()).hexdigest()[:10]
                lora = LoraConfig(rank=config.lora_rank, alpha=config.lora_alpha, seed=config.seed, vision=config.lora_vision)
                self.client = TrainingClient(self.backend, "default", lora, namespace=self.namespace)
                if start:
                    self._restore()
                elif config.init_from:
                    self._warm_start()
            self.trackers = open_run_trackers(  # from this client, as train() does (docs/tracking.md)
                config.report_to, summary=self._config_summary(), run_id=self.run_id, run_dir=self.run_dir, kind="sft",
                backend=self.backend.name, start_step=self.step, steps=self.steps,
            )
        except BaseException as exc:
            self._stop(exc)
            raise

    def _config_summary(self) -> dict:
        return {**self.config.summary(), "steps": self.steps, "train_examples": len(self.train_set), "eval_examples": len(self.eval_set)}

    def _open_run(self):
        config = self.config
        if config.resume:
            run_id = config.run_id or self.host.latest_run_id(config.name)
            coordinator = self.host.open(run_id)
            if coordinator.state.config.get("kind") != "sft":  # checked before anything of that run changes
                raise UserError(
                    f"run {run_id!r} is an RL run, so `sft --resume` cannot continue it",
                    hint=f"resume it with `tinkerless train FILE --resume --run-id {run_id}`, or warm start "
                    f"an SFT run from it with init_from='{run_id}@latest'",
                )
            return coordinator, True
        run_id = config.run_id or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}-{random.randrange(16**4):04x}"
        return self.host.create(run_id, self._config_summary()), False

    def _warm_start(self) -> None:
        self.warm_start = apply_init_from(self.config.init_from, self.client, self.host, self.config.model, self.config.lora_rank)
        print(f"run {self.run_id}: warm start from {self.warm_start.source}", flush=True)

    def _policies(self) -> list[CheckpointPolicy]:
        return [CheckpointPolicy("default", "", self.client.remote("default"), self.version)]

    def _restore(self) -> None:
        restored = self.checkpoints.restore(self._policies(), [CLIENT_STATE_FILE])
        if restored.step is None:  # killed before its first checkpoint: start over, from the warm start if any
            print(f"run {self.run_id}: no valid checkpoint, starting from step 0", flush=True)
            self.coordinator.reset_to_checkpoint(0, self._config_summary())
            self.metrics.truncate_after(-1)
            if self.config.init_from:
                self._warm_start()
            return
        state = json.loads(restored.files[CLIENT_STATE_FILE])
        self.step, self.version = state["step"], state["policy_version"]
        self.coordinator.reset_to_checkpoint(self.step, self._config_summary())
        self.metrics.truncate_after(self.step - 1)
        print(f"run {self.run_id}: resumed from checkpoint step-{self.step}", flush=True)

    def _save_checkpoint(self) -> None:
        files = {CLIENT_STATE_FILE: json.dumps({"step": self.step, "policy_version": self.version, "kind": "sft"}).encode()}
        self.checkpoints.save(self.step, self._policies(), files, {"run_id": self.run_id, "kind": "sft"})
        self.coordinator.record_checkpoint(self.step)

    def run(self) -> RunResult:
        config = self.config
        progress = Progress(total=self.steps, initial=self.step, enabled=config.progress, description=self.run_id)
        try:
            checkpoint_s = 0.0
            while self.step < self.steps:
                record = self._train_step()
                record["storage_s"] = checkpoint_s
                record.update(self.usage.step_columns())
                self.trackers.log_step(record)
                self.metrics.log(record)  # before the checkpoint, as in train(): resume truncates a line without one
                self.step += 1
                started = time.perf_counter()
                if self.step % config.checkpoint_every == 0 or self.step == self.steps:
                    with uninterrupted(), self.usage.phase("storage"):
                        self._save_checkpoint()
                checkpoint_s = time.perf_counter() - started
                progress.update(record)
            progress.close()
            records = [r for r in read_metrics(self.run_dir / "metrics.jsonl") if "step" in r]  # not a tracker's note
            plot = plot_sft(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png", title=self.run_id)
            usage = self.usage.summary()
            self.heartbeat.stop()
            self.coordinator.finish("finished", {**nll_summary(records), "usage": usage})
        except BaseException as exc:
            progress.close()
            self._stop(exc)
            if isinstance(exc, KeyboardInterrupt):
                from tinkerless.sdk.run.lifecycle import RunInterrupted

                name = exc.signal_name if isinstance(exc, RunInterrupted) else "SIGINT"
                raise RunInterrupted(name, self.run_id, self.coordinator.state.last_checkpoint_step) from None
            raise
        free_policies([self.client])
        self.backend.close()
        finish_run_trackers(self.trackers, {**nll_summary(records), "usage": usage}, [plot], self.run_dir / "metrics.jsonl")
        result = RunResult(self.run_id, self.run_dir, records, self.coordinator.state.last_checkpoint_step, Path(plot), [], usage)
        print(_final_report(result), flush=True)
        return result

    def _train_step(self) -> dict:
        config, step = self.config, self.step
        started = time.perf_counter()
        # The coordinator's barrier, as in an RL step: the batch is this step's "rollout".
        self.coordinator.begin_rollout(step, participants=["default"])
        batch = [self.train_set[i] for i in batch_indices(step, config.batch_size, len(self.train_set), config.seed)]
        self.coordinator.submit_rollout(step, "default")
        self.coordinator.wait_rollouts(step, timeout=600.0)
        self.coordinator.begin_update(step)
        adam = AdamParams(learning_rate=config.learning_rate, weight_decay=config.weight_decay, grad_clip_norm=config.grad_clip_norm)
        t = time.perf_counter()
        with self.usage.phase("update"):
            update = self.client.update([datum(e) for e in batch], SFT_LOSS, adam)
        update_s = time.perf_counter() - t
        self.version = update.policy_version
        tokens = sum(len(e.tokens) for e in batch)
        record = {
            "step": step,
            "train_nll": update.metrics.get("loss"),
            "loss": update.metrics.get("loss"),
            "grad_norm": update.metrics.get("grad_norm"),
            "trained_tokens": sum(e.trained_tokens for e in batch),
            "tokens": tokens,
            "tokens_per_s": tokens / update_s if update_s > 0 else None,
            "policy_version": self.version,
            "update_s": update_s,
        }
        if self.eval_set and ((step + 1) % config.eval_every == 0 or step + 1 == self.steps):
            t = time.perf_counter()
            with self.usage.phase("forward"):
                record["eval_nll"] = nll(self.client, self.eval_set)
            record["eval_s"] = time.perf_counter() - t
        self.coordinator.commit_update(step, {"train_nll": record["train_nll"], "usage": self.usage.summary()})
        record["step_s"] = time.perf_counter() - started
        return record

    def _stop(self, exc: BaseException) -> None:
        self.heartbeat.stop()
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        usage = getattr(self, "usage", None)
        try:
            with uninterrupted():
                self.coordinator.finish(status, None if usage is None else {"usage": usage.summary()})
        except Exception as error:
            print(f"run {self.run_id}: could not mark the run {status}: {error}", flush=True)
        except KeyboardInterrupt:
            pass
        finally:
            self.backend.close()
            if getattr(self, "trackers", None) is not None:
                self.trackers.close(status, note=self.metrics.log)


def nll_summary(records: list[dict]) -> dict:
    """First and last train NLL and the last eval NLL, for the run's summary and `tinkerless runs`."""
    train = [r["train_nll"] for r in records if isinstance(r.get("train_nll"), (int, float))]
    evals = [r["eval_nll"] for r in records if isinstance(r.get("eval_nll"), (int, float))]
    return {
        "kind": "sft",
        "steps": len(records),
        "train_nll_first": train[0] if train else None,
        "train_nll_last": train[-1] if train else None,
        "eval_nll_first": evals[0] if evals else None,
        "eval_nll_last": evals[-1] if evals else None,
    }


def _final_report(result: RunResult) -> str:
    summary = nll_summary(result.metrics)
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    return (
        f"run {result.run_id} finished: train NLL {fmt(summary['train_nll_first'])} -> {fmt(summary['train_nll_last'])}, "
        f"eval NLL {fmt(summary['eval_nll_last'])}\n"
        f"  metrics: {result.run_dir / 'metrics.jsonl'}\n  plot:    {result.plot_path}\n"
        f"  checkpoint: step-{result.last_checkpoint_step} (warm start RL with init_from='{result.run_id}@latest')"
        + (f"\n  compute: {format_usage(result.usage)}" if result.usage else "")
    )


__all__ = ["SFT_LOSS", "sft"]
