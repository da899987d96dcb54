"""`train()`: the RL loop, driven from the client, identical for every backend.

Per step: rollout (functions) → group-relative advantages (client; with a teacher, its per-token term) →
optional forward for TIS/KL (functions) → update (functions) → commit (coordinator) → metrics and, every N
steps, a verified checkpoint (storage). The coordinator and checkpoints live where the `RunHost` says: in
`storage`, or on the `tinkerless serve` server the backend talks to. The backend's compute seconds are
attributed to the phase they ran in and priced (`accounting.RunUsage`): per step in the metrics, per run in
the coordinator summary. What the loop sends and keeps lives beside it: the rollout requests (`rollouts`), a
policy's update data (`batches`), what a checkpoint holds and how a resume reads it (`checkpointing`).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinkerless.coordinator import Coordinator
from tinkerless.errors import BudgetExceeded, ServerUnreachable, UserError
from tinkerless.sdk.run.accounting import RunUsage, latest_usage
from tinkerless.sdk.run.batches import update_batch
from tinkerless.sdk.backends.base import Backend, device_of, make_backend, with_usage
from tinkerless.sdk.backends.client import TrainingClient, free_policies
from tinkerless.sdk.run.pipeline import Readers, RolloutPipeline, VersionView, version_for
from tinkerless.sdk.evaluation.evaluate import eval_columns, held_out_tasks, load_adapter_dirs, play as play_eval
from tinkerless.sdk.evaluation.games import play_games
from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.run.lifecycle import Heartbeat, RunInterrupted, heartbeat_interval, interruptible, uninterrupted
from tinkerless.envs.base import is_multi_agent
from tinkerless.sdk.run.agents import every_frozen_adapter, trainable_policies
from tinkerless.sdk.run.checkpointing import CLIENT_STATE_FILE, Checkpoints, _policy_prefix
from tinkerless.sdk.run.metrics import (MetricsWriter, plot_metrics, plot_outcomes, read_metrics, reward_summary)
from tinkerless.sdk.run.multi_agent import build_seats, play_step
from tinkerless.sdk.run.progress import Progress, final_report
from tinkerless.sdk.run.run_budget import RunBudget, stopped
from tinkerless.sdk.run.estimate import dry_run as estimate_run
from tinkerless.sdk.run.reconnect import reconnecting
from tinkerless.sdk.run.rollouts import RolloutRequests, check_errors, step_seed as _step_seed
from tinkerless.sdk.run.step_metrics import agent_metrics, agent_result_metrics, mean, step_record
from tinkerless.sdk.backends.run_host import run_host_for
from tinkerless.sdk.run import distillation, infra_failures, judging, truncation
from tinkerless.sdk.run.step_warnings import StepWarnings
from tinkerless.sdk.run.tasks import TaskSource, check_reset_fields
from tinkerless.sdk.run.transcripts import TRANSCRIPTS_FILE, episode_record, sample as sample_episodes
from tinkerless.sdk.tracking.runs import finish_run_trackers, open_run_trackers
from tinkerless.wire.messages import AdamParams, Episode, LoraConfig

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    metrics: list[dict] = field(default_factory=list)
    last_checkpoint_step: int | None = None
    plot_path: Path | None = None
    events: list[tuple[int, str, str]] = field(default_factory=list)
    usage: dict = field(default_factory=dict)  # compute seconds per phase and function, device, cost (RunUsage.summary)


def train(config: TrainConfig | None = None, *, backend: Backend | str | None = None, dry_run: bool = False,
          **settings: Any) -> RunResult:
    """Train a policy by RL: `train(model=..., env=..., reward=..., tasks=...)` or `train(config)`; dry_run: estimate."""
    if config is None:
        config = TrainConfig().replace(**{k: v for k, v in settings.items() if k != "backend"})
    elif settings:
        config = config.replace(**settings)
    if isinstance(backend, str):
        config = config.replace(backend=backend)
    config.validate()
    if dry_run:  # nothing trained: the run's estimate, printed and returned (sdk/run/estimate.py)
        return estimate_run(config)  # type: ignore[return-value]
    given = backend if not isinstance(backend, (str, type(None))) else None
    with interruptible():  # SIGTERM stops a run like Ctrl-C; a server that went away is waited for (`reconnect`)
        return reconnecting(lambda attempt: _Run(attempt, given).run(), config, given)


class _Run:
    def __init__(self, config: TrainConfig, backend: Backend | None):
        self.config = config
        self.heartbeat_s = heartbeat_interval()  # a bad $TINKERLESS_HEARTBEAT_S fails before anything starts
        # Package user code first: an unpicklable env fails here, before any model loads.
        self.requests = RolloutRequests(config)
        self.tasks = TaskSource(config.tasks, seed=config.seed)
        if config.env is not None:
            check_reset_fields(config.env, self.tasks, count=config.batch_size)
        self.multi_agent = config.env is not None and is_multi_agent(config.env)
        self.eval_tasks = held_out_tasks(config) if config.eval_every else None  # a bad set fails before the model loads
        self.policies = trainable_policies(config.agents) if self.multi_agent else ["default"]
        self.frozen = every_frozen_adapter(config.agents, config.eval_agents) if self.multi_agent else {}  # path -> policy
        self.seats = build_seats(config.agents, self.frozen) if self.multi_agent else []
        self.events: list[tuple[int, str, str]] = []  # (step, event, policy): the barrier's observable order
        self.backend = with_usage(
            backend
            or make_backend(config.backend, config.model, engine=config.engine, micro_batch_size=config.micro_batch_size,
                            dtype=config.dtype, run_config=config, **config.local_backend_options())
        )
        try:
            # The run's state and checkpoints: in `storage`, or on the server the backend talks to.
            self.host = run_host_for(self.backend, config.storage, config.storage_options)
            if config.init_from and not config.resume:  # a wrong source fails before the run exists
                from tinkerless.sdk.checkpoints.warm_start import check_init_from

                check_init_from(config.init_from, self.host, config.model, config.lora_rank)
            distillation.check_teacher_held(config, self.backend)  # a teacher the server lacks: before the run exists
            self.coordinator, start = self._open_run()
        except BaseException:
            self.backend.close()
            raise
        self.run_id = self.coordinator.run_id
        self.heartbeat = Heartbeat(self.coordinator, self.heartbeat_s).start()
        self.checkpoints = Checkpoints(
            self.host.checkpoints(self.run_id, config.keep_checkpoints, self.coordinator), self.coordinator
        )
        self.run_dir = self.host.run_dir(self.run_id)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl")
        self.transcripts = MetricsWriter(self.run_dir / TRANSCRIPTS_FILE)  # a sample of each step's episodes
        self.cursor = 0
        self.step = 0
        self._versions: dict[str, int] = {}
        self.warnings = StepWarnings(config)
        try:
            # A resumed run goes on billing from what its earlier attempts used.
            prior = latest_usage(self.coordinator.state.summary) if start else None
            self.usage = RunUsage(self.backend.usage, config.price_table(), prior=prior)
            with self.usage.phase("setup"):
                self.usage.device = device_of(self.backend)
                # Worker-side policy names are scoped to this run: a shared server holds many runs' adapters.
                self.namespace = "r" + hashlib.sha256(f"{self.host.where}|{self.run_id}".encode()).hexdigest()[:10]
                self.clients = {
                    name: TrainingClient(
                        self.backend,
                        policy=name,
                        lora=LoraConfig(rank=config.lora_rank, alpha=config.lora_alpha, seed=config.seed + i,
                                        vision=config.lora_vision),
                        namespace=self.namespace,
                    )
                    for i, name in enumerate(self.policies)
                }
                load_adapter_dirs(self.backend, self.frozen, self.namespace)
                self.teacher = distillation.open_teacher(config, self.backend, self.namespace, self.host, self.usage, self._say)
                self._reader_versions: list[int] = []  # a resumed async run's readers, kept in its checkpoint
                if start:
                    self._restore()
                elif config.init_from:
                    self._warm_start()
                self.pipeline = self._start_pipeline() if config.max_staleness else None
            # From this client, whatever the backend (docs/tracking.md); a resume continues the same tracker runs.
            self.trackers = open_run_trackers(
                config.report_to, summary=config.summary(), run_id=self.run_id, run_dir=self.run_dir, kind="train",
                backend=self.backend.name, start_step=self.step, steps=config.steps,
                policies=self.policies if self.multi_agent else (),
            )
        except BaseException as exc:
            self._stop(exc)  # never leave a run that looks alive
            if isinstance(exc, KeyboardInterrupt):
                raise self._interrupted(exc) from None
            raise

    def _open_run(self) -> tuple[Coordinator, bool]:
        config = self.config
        if config.resume:
            run_id = config.run_id or self.host.latest_run_id(config.name)
            coordinator = self.host.open(run_id, limits={k: getattr(config, k) for k in ("max_compute_seconds", "max_cost_usd")})
            if coordinator.state.config.get("kind") == "sft":  # checked before anything of that run changes
                raise UserError(
                    f"run {run_id!r} is an SFT run, so `train --resume` cannot continue it",
                    hint=f"resume it with `tinkerless sft DATA --resume --run-id {run_id}`, or start an RL run "
                    f"from it with init_from='{run_id}@latest'",
                )
            return coordinator, True
        run_id = config.run_id or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}-{random.randrange(16**4):04x}"
        return self.host.create(run_id, config.summary()), False

    # ---- checkpoints (what one holds and how it is written and read: `checkpointing`) ----
    def _restore(self) -> None:
        restored = self.checkpoints.restore(self.clients)
        if restored is None:
            self._say(f"run {self.run_id}: no valid checkpoint, starting from step 0")
            self.coordinator.reset_to_checkpoint(0, self.config.summary())
            self.metrics.truncate_after(-1)
            self.transcripts.truncate_after(-1)
            if self.config.init_from:  # the reset dropped the warm start: load it again
                self._warm_start()
            return
        self._versions.update(restored.policy_versions)
        self.step, self.cursor = restored.step, restored.cursor
        self._reader_versions = restored.reader_versions
        self.coordinator.reset_to_checkpoint(self.step, self.config.summary())
        self.metrics.truncate_after(self.step - 1)
        self.transcripts.truncate_after(self.step - 1)
        self.tasks.replay([r for r in read_metrics(self.run_dir / "metrics.jsonl") if "step" in r])  # a curriculum's level
        self._say(f"run {self.run_id}: resumed from checkpoint step-{self.step}")

    def _warm_start(self) -> None:
        from tinkerless.sdk.checkpoints.warm_start import apply_init_from

        config = self.config
        loaded = apply_init_from(config.init_from, self.clients["default"], self.host, config.model, config.lora_rank)
        self._say(f"run {self.run_id}: warm start from {loaded.source}")

    # ---- the loop ----------------------------------------------------------------
    def run(self) -> RunResult:
        config = self.config
        progress = Progress(total=config.steps, initial=self.step, enabled=config.progress, description=self.run_id)
        self.budget = RunBudget(config.max_cost_usd, config.max_compute_seconds, self.usage, step=self.step)
        try:
            checkpoint_s = 0.0  # a checkpoint's time is reported with the next step's record
            while self.step < config.steps:
                if reason := self.budget.stop_reason(self.run_id, self.step, config.steps):  # before the step's work
                    with uninterrupted():
                        self.checkpoints.finish()  # the checkpoint of the step it stops at is committed first
                    raise stopped(reason, self.run_id, self.coordinator.state.last_checkpoint_step)
                held_out = self._held_out_eval() if config.eval_every and self.step % config.eval_every == 0 else {}
                record, policy_versions = self._train_step()
                record.update(held_out)
                record.update(self.tasks.observe_step(record))  # a task source that follows the run (a curriculum)
                with uninterrupted():
                    checkpoint_s += self.checkpoints.finish(wait=False)  # committed by now, as a rule
                record["storage_s"] += checkpoint_s
                record.update(self.usage.step_columns())
                self.trackers.log_step(record, self._step_episodes)  # before the line: it notes a tracker's failure
                # The step's line goes out before its checkpoint: a crash in between leaves a line that
                # resume truncates (it resumes from the previous checkpoint), never a checkpoint without its line.
                self.metrics.log(record)
                self.step += 1
                if self.pipeline is not None:
                    self._advance_pipeline()
                started, stopping = time.perf_counter(), self.budget.step_done(self.run_id, self.step, config.steps)
                if self.step % config.checkpoint_every == 0 or self.step == config.steps or stopping:
                    with uninterrupted(), self.usage.phase("storage"):  # save_state runs on the functions
                        readers = self.pipeline.versions_needed(self.step) if self.pipeline is not None else []
                        self.checkpoints.save(self.step, self.cursor, self.clients, policy_versions, self.run_id,
                                              readers=self.readers.checkpoint_policies(readers) if readers else [])
                checkpoint_s = time.perf_counter() - started
                progress.update(record)
                if "warning" in record:
                    progress.warn(record["warning"])
                for error in record.get("errors", [])[:1]:
                    progress.write(f"step {record['step']}: episode dropped: {error['error']}")
                if dropped := infra_failures.describe(record, config.infra_retries):
                    progress.warn(dropped)
            with uninterrupted(), self.usage.phase("storage"):
                self.checkpoints.finish()  # the last checkpoint is committed before the run is finished
            progress.close()
            records = [r for r in read_metrics(self.run_dir / "metrics.jsonl") if "step" in r]  # not a tracker's note
            plot = plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.png", title=self.run_id)
            usage = self.usage.summary()
            self.heartbeat.stop()
            self.coordinator.finish("finished", {**reward_summary(records), "usage": usage})
        except BaseException as exc:
            progress.close()
            self._stop(exc)  # cloud backends stop their apps and clusters' clients here too
            if isinstance(exc, KeyboardInterrupt):
                raise self._interrupted(exc) from None
            raise
        if self.pipeline is not None:
            self.pipeline.close()
            self.readers.close()
        free_policies([*self.clients.values(), *self._frozen_clients(), *distillation.teacher_clients(self.teacher)])
        self.backend.close()
        outcomes = None
        if self.multi_agent:
            outcomes = plot_outcomes(self.run_dir / "metrics.jsonl", self.run_dir / "outcomes.png", self.policies,
                                     title=self.run_id)
        finish_run_trackers(self.trackers, {**reward_summary(records), "usage": usage}, [plot, outcomes],
                            self.run_dir / "metrics.jsonl")
        result = RunResult(
            self.run_id, self.run_dir, records, self.coordinator.state.last_checkpoint_step, Path(plot), self.events, usage
        )
        self._say(final_report(result))
        return result

    def _stop(self, exc: BaseException) -> None:
        """End a run that raised: `interrupted` for Ctrl-C/SIGTERM, else `failed`; then free the backend."""
        self.heartbeat.stop()
        if getattr(self, "pipeline", None) is not None:
            self.pipeline.close(wait=False)  # rollouts running ahead are dropped: a resume plays them again
        status = "interrupted" if isinstance(exc, (KeyboardInterrupt, BudgetExceeded, ServerUnreachable)) else "failed"
        exc.run_id = self.run_id  # type: ignore[attr-defined] # what a reconnect resumes (ServerUnreachable)
        try:
            with uninterrupted():  # a checkpoint being written still commits: a resume starts from it
                self.checkpoints.finish()
        except Exception as error:  # the previous checkpoint stays in force
            self._say(f"run {self.run_id}: the checkpoint being written did not commit: {error}")
        try:
            with uninterrupted():  # a second signal must not leave the run marked running
                self.coordinator.finish(status, self._usage_summary())
        except Exception as error:  # keep the run's own error; the stale heartbeat will tell the story
            self._say(f"run {self.run_id}: could not mark the run {status}: {error}")
        except KeyboardInterrupt:  # a second signal while marking it: the run is stopping anyway
            pass
        finally:
            self.backend.close()
            if getattr(self, "trackers", None) is not None:  # their runs marked failed or killed; a resume reopens them
                self.trackers.close(status, note=self.metrics.log)

    def _interrupted(self, exc: KeyboardInterrupt) -> RunInterrupted:
        name = exc.signal_name if isinstance(exc, RunInterrupted) else "SIGINT"
        return RunInterrupted(name, self.run_id, self.coordinator.state.last_checkpoint_step)

    def _usage_summary(self) -> dict | None:  # what a failed run used so far (None: it failed before its backend)
        return None if getattr(self, "usage", None) is None else {"usage": self.usage.summary()}

    def _held_out_eval(self) -> dict:
        """eval_every: the policy this step samples from plays eval_tasks (same seed every time), never trained on."""
        with self.usage.phase("rollout"):
            if self.multi_agent:  # the eval seatings' games, win rates per policy (evaluation/games.py)
                return play_games(next(iter(self.clients.values())).rollout_multi, self.config, self.eval_tasks,
                                  policies=self.policies, frozen=self.frozen)
            report = play_eval(self.clients["default"], self.config, self.eval_tasks,
                                  samples=self.config.group_size, seed=self.config.seed)
        return eval_columns(report)

    def _train_step(self) -> tuple[dict, dict[str, int]]:
        config, step = self.config, self.step
        timings = {"rollout_s": 0.0, "forward_s": 0.0, "update_s": 0.0, "storage_s": 0.0}
        self._rollout_stats: dict = {}
        started = time.perf_counter()
        with self.usage.phase("rollout"):
            self.coordinator.begin_rollout(step, participants=self.policies)
            if self.pipeline is None:
                tasks, self.cursor = self.tasks.batch(self.cursor, config.batch_size)
                episodes = self._multi_agent_rollouts(tasks) if self.multi_agent else self._rollouts(tasks)
            else:  # played ahead (`pipeline`): they reach the barrier now, as this step's
                tasks, self.cursor, episodes, self._rollout_stats = self.pipeline.take(step)
                for name in self.policies:
                    self.coordinator.submit_rollout(step, name)
                    self._event("rollouts_in", name)
            # global barrier: every policy's rollouts are in
            self.coordinator.wait_rollouts(step, timeout=config.protocol_timeout)
        timings["rollout_s"] = time.perf_counter() - started
        episodes, dropped = infra_failures.split(episodes, step, config.infra_retries)  # out of the step: not rewards
        check_errors(episodes, config, step)

        self.coordinator.begin_update(step)
        metrics: dict[str, dict] = {}
        versions: dict[str, int] = {}
        for name, client in self.clients.items():
            self._event("update_start", name)
            own = [e for e in episodes if e.status != "error" and e.info.get("policy", "default") == name]
            metrics[name], versions[name] = self._update(client, own, timings)
        reward_mean = mean([e.reward for e in episodes if e.status != "error"])
        # Usage so far rides along, so a killed run's state still says what it used (and a resume adds to it).
        self.coordinator.commit_update(step, {"reward_mean": reward_mean, "usage": self.usage.summary()})
        self._event("committed", "*")
        record = step_record(step, episodes, metrics, timings, versions, time.perf_counter() - started, self._rollout_stats)
        record["staleness"] = step - version_for(step, config.max_staleness)  # versions between sampler and update
        record.update({**infra_failures.columns(dropped, self._rollout_stats), **truncation.columns(episodes, config.turn_limit()),
                       **judging.step_columns(self.requests.judge, self._rollout_stats, timings["rollout_s"], self.usage)})
        if warning := self.warnings.check(record):  # once per run each: the metrics line and the console say it
            record["warning"] = warning
        if self.multi_agent:
            record.update(agent_metrics(episodes, self.policies))
        record.update(agent_result_metrics(episodes))
        limits = self.config.episode_limits()
        self._step_episodes = []  # the transcripts episodes.jsonl gets, and the trackers' tables
        # Every dropped episode is written, whatever the sample: its cause is what a user reads to see what failed.
        for episode in [*sample_episodes(episodes, config.transcripts_per_step), *dropped]:
            task = tasks[episode.task_index] if 0 <= episode.task_index < len(tasks) else None
            self._step_episodes.append(episode_record(episode, limits, step=step, task=task))
            self.transcripts.log(self._step_episodes[-1])
        return record, versions

    # ---- rollouts ahead of the update (max_staleness >= 1: `pipeline`) ----------------
    def _start_pipeline(self) -> RolloutPipeline:
        """Readers of the versions the next steps sample from (a resume's from its checkpoint), and the pipeline."""
        k = self.config.max_staleness
        self.readers = Readers(self.clients, self.namespace)
        self.readers.open(self.step, k, self._reader_versions, lambda policies: (
            self.checkpoints.store.restore(policies, [], step=self.step, driver=False)))
        self._play_cursor = self.cursor
        return RolloutPipeline(k, self.config.steps, self.readers, self._play, first_step=self.step)

    def _advance_pipeline(self) -> None:
        """After step `self.step - 1` committed: publish the new version, free the ones no step samples from."""
        self.readers.publish(self.step)  # even past the last step: its checkpoint keeps it for a longer resumed run
        self.readers.retire(below=version_for(self.step, self.config.max_staleness))
        self.pipeline.fill(self.step)

    def _play(self, step: int, view: VersionView) -> tuple[list[dict], int, list[Episode], dict]:
        """Step `step`'s rollouts through `view` (on the pipeline's thread, in step order): its tasks, the cursor
        after them, its episodes and the rollouts' stats. Nothing here touches the coordinator."""
        tasks, self._play_cursor = self.tasks.batch(self._play_cursor, self.config.batch_size)
        if self.multi_agent:
            episodes, stats = play_step(self.seats, lambda seats, i: self.requests.multi_agent(tasks, step, seats, i),
                                        view.rollout_multi, None, step, lambda event, policy: None)
            return tasks, self._play_cursor, episodes, stats
        result = infra_failures.play(view.rollout, self.requests.single_agent(tasks, step), self.config.infra_retries)
        return tasks, self._play_cursor, result.episodes, result.stats

    def _rollouts(self, tasks: list[dict]) -> list[Episode]:
        request = self.requests.single_agent(tasks, self.step)
        result = infra_failures.play(self.clients["default"].rollout, request, self.config.infra_retries)
        self._rollout_stats = result.stats  # where the rollout's seconds and tokens went, for the metrics
        self.coordinator.submit_rollout(self.step, "default")
        self._event("rollouts_in", "default")
        return result.episodes

    def _multi_agent_rollouts(self, tasks: list[dict]) -> list[Episode]:
        def make_request(seats, index):
            return self.requests.multi_agent(tasks, self.step, seats, index)

        any_client = next(iter(self.clients.values()))
        episodes, self._rollout_stats = play_step(
            self.seats, make_request, any_client.rollout_multi, self.coordinator, self.step, self._event
        )
        return episodes

    def _update(self, client: TrainingClient, episodes: list[Episode], timings: dict) -> tuple[dict, int]:
        config = self.config
        data, loss = update_batch(client, episodes, config, self.usage, timings, self.teacher)
        if not data:  # every group had equal rewards: no signal, no step
            return {"trained_sequences": 0}, self._versions.get(client.policy, 0)
        t = time.perf_counter()
        adam = AdamParams(learning_rate=config.learning_rate, weight_decay=config.weight_decay, grad_clip_norm=config.grad_clip_norm)
        with self.usage.phase("update"):
            update = client.update(data, loss, adam, max_staleness=config.max_staleness)  # checked per token
        timings["update_s"] += time.perf_counter() - t
        self._versions[client.policy] = update.policy_version
        return {**update.metrics, "trained_sequences": len(data)}, update.policy_version

    def _event(self, event: str, policy: str) -> None:
        self.events.append((self.step, event, policy))

    def _frozen_clients(self) -> list[TrainingClient]:
        return [TrainingClient(self.backend, name, create=False, namespace=self.namespace) for name in self.frozen.values()]

    def _say(self, message: str) -> None:
        print(message, flush=True)


__all__ = ["RunResult", "train"]
# Still importable from here after their move: evaluation and sft read CLIENT_STATE_FILE, tests and bench _step_seed.
__all__ += ["CLIENT_STATE_FILE", "_policy_prefix", "_step_seed"]
