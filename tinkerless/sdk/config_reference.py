"""The reference of every `TrainConfig` field, generated from the dataclass so it cannot drift.

Names, types and defaults come from `dataclasses.fields(TrainConfig)`; each field's meaning
from `FIELD_DOCS`, or else from the comment on the field's line in `config.py`. The section
a field belongs to is the comment line above its group there. `tinkerless config-reference`
prints the Markdown, which is committed as docs/config.md (a test keeps the two equal), and
`tinkerless train --help` shows the same meanings for its flags.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize

from tinkerless.sdk.config import TrainConfig

FIELD_DOCS: dict[str, str] = {
    "model": "The base model: `smollm2` (SmolLM2-135M-Instruct, bundled, no download), `tiny` (a ~0.1M-parameter "
    "random model built from a config: only for trying an env quickly, it learns nothing useful), a local "
    "model directory, or a Hugging Face hub id.",
    "env": "A multi-turn environment class (`@tinkerless.env`, with `reset(**task)` and `step(action)`), or a "
    "multi-agent env (with `agents` and `turn()`). None for single-turn runs scored by `reward` alone.",
    "reward": "`@tinkerless.reward def r(completion, task) -> float`. The completion is the model's text in a "
    "single-turn run, the transcript (a list of chat messages) in an env run, where it is added to the env's "
    "per-turn rewards.",
    "tasks": "The tasks: a list of dicts, a JSONL path, or a task function `f(rng) -> dict` of a seeded "
    "`random.Random`. Single-turn tasks carry `prompt` (or `messages`); env tasks carry what `reset` takes.",
    "system_prompt": "A system message put before a single-turn task's `prompt` (tasks given as `messages` "
    "are used as they are), and before an env's first message unless the env defines `system_prompt()`.",
    "agents": "Multi-agent envs only: who plays each role: role -> policy name, `tinkerless.Frozen(...)` or an "
    "opponent function; or a list of such seatings (`self_play`, `versus`, `round_robin` build them).",
    "protocol_timeout": "Seconds before a stuck multi-agent protocol or rollout barrier becomes an error.",
    "name": "The run's name: new run ids are `<name>-<date>-<time>-<hex>`, and `resume=True` without a "
    "`run_id` resumes the newest run of this name.",
    "algo": "`grpo` (group-relative advantages, std-normalized) or `dr_grpo` (no std, constant loss "
    "normalization).",
    "loss": "`importance_sampling`, `ppo` (clipped), `cispo`, or `cross_entropy` (supervised).",
    "normalization": "How the loss is averaged: `token`, `sequence` or `constant`; None takes the algo's default "
    "(`sequence` for grpo, `constant` for dr_grpo).",
    "clip_low": "Lower clip of the probability ratio (ppo, cispo): 1 - clip_low.",
    "clip_high": "Upper clip of the probability ratio (ppo, cispo): 1 + clip_high.",
    "tis_cap": "Truncated importance-sampling cap for the sampler/trainer mismatch; the trainer's log-probs come from the update's own pass (no extra forward). "
    "None: off.",
    "teacher": "On-policy distillation (docs/distillation.md): a teacher scores every sampled token and the "
    "per-token reverse KL is the advantage. `base`, a model id or directory, a checkpoint `RUN@STEP` / "
    "`RUN@latest` (the student's own earlier one too), or an OpenAI-compatible endpoint URL returning prompt "
    "log-probs. None: no teacher.",
    "distill_coef": "Weight of the teacher's per-token term (teacher minus sampler log-prob) in the advantage; the "
    "env reward's group advantage is added to it.",
    "distill_loss": "`reverse_kl`: the teacher's per-token log-prob minus the sampler's as the advantage (the "
    "cookbook's OPD); `topk_forward_kl`: the teacher's top-k next-token distribution at each sampled position as "
    "the target of a forward KL (a teacher on the policy's worker with its tokenizer; the reward is not used).",
    "distill_topk": "k of `topk_forward_kl`: the teacher's k most likely tokens per position (1 to 1024).",
    "kl_coef": "Weight of the k3 KL penalty to the base model (the adapter switched off); 0: no penalty.",
    "learning_rate": "Adam learning rate of the LoRA adapter.",
    "weight_decay": "AdamW weight decay.",
    "grad_clip_norm": "Gradients are clipped to this global norm.",
    "lora_rank": "LoRA rank of the trained adapter.",
    "lora_alpha": "LoRA alpha (the adapter's scale is alpha / rank).",
    "lora_vision": "A vision-language model's parts trained beside its language model (LoRA on their linear "
    "layers): `none` (tower and connector frozen), `connector` (the projector too) or `tower` (both); docs/vision.md.",
    "steps": "Training steps (one rollout batch and one optimizer step each).",
    "batch_size": "Tasks per step.",
    "group_size": "Episodes per task; advantages are relative to the task's group.",
    "max_tokens": "Tokens the model may sample per turn.",
    "temperature": "Sampling temperature.",
    "top_p": "Nucleus-sampling probability mass (1.0: off).",
    "max_turns": "Most model turns per episode; an env episode still going after them ends as `truncated`. "
    "None: 16 for an env run, 1 for a single-turn reward run. In an agent run: the most completion calls one "
    "agent copy may make (None: 16); a call past them is answered with a 400.",
    "max_episode_tokens": "Most tokens per episode (prompt, turns and observations); an episode that would "
    "exceed it ends as `truncated`. In an agent run: the longest prompt + completion one call may use.",
    "seed": "Seed of task order, sampling and LoRA init: the same seed gives the same run.",
    "backend": "Where the model work runs: `local` (this machine), `modal`, `sky` / `sky:<cluster>` "
    "(SkyPilot), or `http://host:port` (a `tinkerless serve` server).",
    "engine": "Generation engine: `auto` (vLLM when it and a GPU are present), `transformers` or `vllm`.",
    "dtype": "Precision of the base weights: `auto` (bf16 on a CUDA GPU that supports it, fp32 on a CPU), `bf16` or "
             "`fp32`. LoRA weights, optimizer state, log-softmax and losses stay fp32; adapters load across dtypes. "
             "On a `tinkerless serve` server its `--dtype` decides (docs/performance.md).",
    "storage": "Where runs live: a directory or an fsspec URL (`s3://bucket/prefix`). Runs are under "
    "`<storage>/runs/<run_id>/`.",
    "storage_options": "fsspec options for `storage`, e.g. `{'client_kwargs': {'endpoint_url': ...}}`; never "
    "saved with the run, since they may hold credentials.",
    "run_id": "The run's id (letters, digits, `.`, `_`, `-`); None: a fresh one from `name`.",
    "resume": "Continue run `run_id` (or the newest run named `name`) from its latest checkpoint.",
    "checkpoint_every": "Steps between checkpoints (the last step always gets one).",
    "keep_checkpoints": "How many newest checkpoints to keep; None keeps all.",
    "on_env_error": "`skip`: an episode whose env or reward raised is dropped (its traceback goes into "
    "metrics.jsonl); `raise`: the run stops.",
    "reconnect_timeout": "A run through a `tinkerless serve` whose server died or restarted waits up to this many "
    "seconds for it to answer again (backoff from 0.5 s to 5 s), then resumes from its last checkpoint on a fresh "
    "call stream, ending exactly as an uninterrupted run (docs/errors.md). 0: it fails at once.",
    "infra_retries": "How many times an episode that failed for an infrastructure reason (its env server, judge, "
    "sandbox or hosted agent failed: an `InfrastructureFailure`) is played again; one that still fails is dropped "
    "from its group, whose advantages are computed over the episodes left, and counted as `episodes_infra_failed` "
    "(never scored 0; docs/errors.md). 0 to 10.",
    "micro_batch_size": "Sequences per forward/backward pass in an update (gradients accumulate over them); "
    "lower it if memory runs out.",
    "progress": "Show the progress bar (`--no-progress` turns it off).",
    "transcripts_per_step": "Whole episodes per step written to `runs/<id>/episodes.jsonl` (messages, "
    "per-turn rewards, token counts, status); 0: none.",
    "prices": "Device name -> $/hour, tried before the built-in list prices (e.g. `{'H100': 3.95}`).",
    "max_cost_usd": "The run's budget in dollars (its device-seconds at `prices`): before each step the run checks "
    "that the step still fits, expecting it to cost as much as its costliest step so far; when it does not, the run "
    "saves a checkpoint and stops with `BudgetExceeded` (marked interrupted). Raise it and resume: the run goes on "
    "exactly as if it had never stopped (docs/budgets.md). None: no limit.",
    "max_compute_seconds": "The same budget in device-seconds (`compute_s/total`); None: no limit.",
    "price_per_hour": "One flat $/hour for whatever device runs the functions (overrides `prices`).",
    "report_to": "Experiment trackers to log the run to: any of `wandb`, `tensorboard`, `mlflow` (each an extra: "
    "`pip install 'tinkerless[wandb]'`). Per-step metrics, the config, sample transcripts, the cost summary and the "
    "plot go there from the client process, on every backend; a resume continues the same tracker runs, and a "
    "tracker that fails is switched off without stopping the run (docs/tracking.md). Empty: none.",
}


def field_reference() -> list[dict]:
    """Every TrainConfig field: name, type, default (as Python source), section and meaning."""
    comments, sections = _source_comments()
    out = []
    for f in dataclasses.fields(TrainConfig):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        out.append(
            {
                "name": f.name,
                "type": f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type)),
                "default": default,
                "section": sections.get(f.name, "other"),
                "doc": FIELD_DOCS.get(f.name) or comments.get(f.name, ""),
            }
        )
    return out


def field_help(name: str) -> str:
    """One field's meaning and default, for a command-line flag's help."""
    for entry in field_reference():
        if entry["name"] == name:
            return f"{entry['doc']} (default: the file's TrainConfig.{name}, else {entry['default']})".replace("%", "%%")
    raise KeyError(name)


def render_markdown() -> str:
    lines = [
        "# TrainConfig reference",
        "",
        "<!-- Generated by `tinkerless config-reference > docs/config.md`; do not edit by hand.",
        "     tests/test_config_reference.py fails when this file and the dataclass disagree. -->",
        "",
        "Every field of `tinkerless.TrainConfig`. Set them in the config file",
        "(`config = tinkerless.TrainConfig(...)`), as keyword arguments of `tinkerless.train(...)`,",
        "or, for the common ones, as `tinkerless train` flags (`--batch-size 4`; see `tinkerless train --help`).",
        "A misspelled field is a `ConfigError` that names the closest field.",
    ]
    section = None
    for entry in field_reference():
        if entry["section"] != section:
            section = entry["section"]
            lines += ["", f"## {section[:1].upper()}{section[1:]}", "", "| field | type | default | meaning |", "|---|---|---|---|"]
        cells = [f"`{entry['name']}`", f"`{entry['type']}`", f"`{entry['default']}`", entry["doc"]]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _source_comments() -> tuple[dict[str, str], dict[str, str]]:
    """From TrainConfig's source: each field's trailing comment, and the section comment above it."""
    source = inspect.getsource(TrainConfig)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    comments: dict[str, str] = {}
    sections: dict[str, str] = {}
    section, line_field, pending = None, None, []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.start[1] == 4 and token.string in names and line_field is None:
            line_field = token.string
            if section:
                sections[line_field] = section
        elif token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if line_field is not None:
                comments[line_field] = text
            elif token.start[1] == 4:
                pending.append(text)
        elif token.type == tokenize.NEWLINE:
            line_field = None
        elif token.type == tokenize.NL and pending and line_field is None:
            # A comment on a line of its own: a short one heads a section; longer ones describe the next field.
            if len(pending) == 1 and len(pending[0]) < 40 and ":" not in pending[0]:
                section = pending[0]
            pending = []
    return comments, sections
