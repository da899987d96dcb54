"""The episode loop of a vision-language policy: tasks with images, envs that show images, rewards that see them.

The text loop's rules hold (`rollout.agent_loop`): sampled tokens keep mask 1 and the sampler's log-probs; the
prompt, observations and every image token get mask 0; an env or reward that raises ends only its episode.
What differs:
- a single-turn task may carry `images` beside its `prompt` (or content parts in its `messages`);
- an env's `reset` and `step` may return a string or a list of content parts (text and images);
- the transcript's user messages keep their `ImagePart`s, so a reward sees the images;
- the episode keeps each image processed (`VisionInput`: pixels, grid, content hash), in token order, for the
  update; episodes.jsonl refers to the images by hash (`content.transcript_for_disk`).
"""

from __future__ import annotations

from typing import Any, Callable

from tinkerless.envs.base import as_step_result
from tinkerless.errors import DatasetError, InvalidRequest
from tinkerless.functions.hosting.user_code import call_each
from tinkerless.functions.rollout.agent_loop import (_NOT_STEPPED, EpisodeState, TokenCounts, _completion,
                                                      _env_name, _final_reward, _outcome, _Run, _to_episode)
from tinkerless.functions.vision.processing import VisionChat
from tinkerless.functions.vision.sampler import VisionPrompt, VisionSampler, VisionSession
from tinkerless.wire.content import TextPart, VisionInput, image_part, text_of, to_parts
from tinkerless.wire.messages import Episode, EpisodeLimits, SamplingParams


def _user_content(task: dict) -> Any:
    """A single-turn task's user message: the prompt, with the task's images before it as content parts."""
    images = task.get("images") or []
    if not images:
        return str(task["prompt"])
    return [*(image_part(im, "task['images']") for im in images), TextPart(str(task["prompt"]))]


def _first_messages(run: _Run, env_cls: Any, system_prompt: str | None) -> list[dict]:
    messages: list[dict] = []
    if env_cls is None:
        task = run.task
        if "messages" in task:
            return [{**m, "content": to_parts(m["content"], "task['messages']")} for m in task["messages"]]
        if "prompt" not in task:
            raise DatasetError(f"task {run.task_index} has no 'prompt' (keys: {sorted(task)})",
                               hint="single-turn tasks need a 'prompt' (and may carry 'images'), or 'messages'")
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": _user_content(task)})
        return messages
    env = run.env
    system = env.system_prompt() if hasattr(env, "system_prompt") else system_prompt
    if system:
        messages.append({"role": "system", "content": system})
    first = to_parts(env.reset(**run.task), "env.reset()")
    if hasattr(env, "initial_user_message"):
        first = _joined(to_parts(env.initial_user_message(), "env.initial_user_message()"), first)
    messages.append({"role": "user", "content": first})
    return messages


def _joined(a: Any, b: Any) -> Any:
    if isinstance(a, str) and isinstance(b, str):
        return "\n\n".join(p for p in (a, b) if p)
    as_list = lambda c: [TextPart(c)] if isinstance(c, str) else list(c)  # noqa: E731
    return [*as_list(a), TextPart("\n\n"), *as_list(b)]


def run_vision_episodes(
    sampler: VisionSampler, chat: VisionChat, *, policy: str | None, tasks: list[dict], group_size: int,
    sampling: SamplingParams, limits: EpisodeLimits, seed: int, env_cls: Any = None, reward_fn: Callable | None = None,
    system_prompt: str | None = None, counts: TokenCounts | None = None,
) -> list[Episode]:
    counts = counts if counts is not None else TokenCounts()
    runs = [_Run(task_index=i, task=task) for i, task in enumerate(tasks) for _ in range(group_size)]
    images: dict[int, list[VisionInput]] = {id(r): [] for r in runs}
    sessions: dict[int, VisionSession] = {}
    env_name = _env_name(env_cls) if env_cls is not None else None
    for run in runs:
        try:
            if env_cls is not None:
                run.env = env_cls()
            messages = _first_messages(run, env_cls, system_prompt)
            tokens, parts = chat.prompt(messages)
        except (DatasetError, InvalidRequest):
            if env_cls is None:
                raise  # the client's own task is malformed: the whole request is refused
            run.fail(f"{env_name}.reset", _current())
            continue
        except Exception as exc:
            run.fail(f"{env_name}.reset" if env_name else "prompt", exc)
            continue
        run.transcript = list(messages)
        run.append(tokens, sampled=False)
        images[id(run)] += [chat.processor.process(p) for p in parts]
        run.prompt_length = len(run.tokens)
        run.state = EpisodeState.GENERATING
        if env_cls is not None and limits.max_turns > 1:
            sessions[id(run)] = VisionSession()
    try:
        turn = 0
        while True:
            active = [r for r in runs if r.state is EpisodeState.GENERATING]
            if not active:
                break
            budgets = [limits.max_episode_tokens - len(r.tokens) for r in active]
            turn_sampling = SamplingParams(max_tokens=max(0, min(sampling.max_tokens, max(budgets))),
                                           temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
            generations = sampler.generate(
                [VisionPrompt(list(r.tokens), list(images[id(r)])) for r in active], turn_sampling, policy=policy,
                seed=seed * 1_000_003 + turn, sessions=[sessions.get(id(r)) for r in active])
            counts.add(generations)
            turn += 1
            texts, last_tokens = [], []
            for run, generation, budget in zip(active, generations, budgets):
                kept = max(budget, 0)
                run.append(generation.tokens[:kept], sampled=True, logprobs=generation.logprobs[:kept])
                last_tokens.append(generation.tokens[:kept][-1] if generation.tokens[:kept] else None)
                texts.append(chat.chat.decode(generation.tokens[:kept]))
                run.transcript.append({"role": "assistant", "content": texts[-1]})
                run.state = EpisodeState.INTERACTING
            stepped = call_each([r.env for r in active], "step", [(t,) for t in texts]) if env_cls is not None else None
            for i, run in enumerate(active):
                _interact(run, images[id(run)], chat, env_name, limits, last_tokens[i],
                          stepped[i] if stepped is not None else _NOT_STEPPED)
                if run.state is not EpisodeState.GENERATING and id(run) in sessions:
                    sessions.pop(id(run)).close()
    finally:
        for session in sessions.values():
            session.close()
    scored = [r for r in runs if r.status != "error"] if reward_fn is not None else []
    rewards = call_each([reward_fn] * len(scored), "", [(_completion(r, env_cls is None), r.task) for r in scored])
    for run, value in zip(scored, rewards if rewards is not None else [_NOT_STEPPED] * len(scored)):
        _final_reward(run, reward_fn, env_cls is None, value)
    episodes = []
    for run in runs:
        episode = _to_episode(run)
        episode.images = images[id(run)] if run.status != "error" else []
        episodes.append(episode)
    return episodes


def _current() -> BaseException:
    import sys

    return sys.exc_info()[1] or RuntimeError("unknown")


def _interact(run: _Run, images: list[VisionInput], chat: VisionChat, env_name: str | None, limits: EpisodeLimits,
              last_token: int | None, stepped: Any) -> None:
    turns = sum(1 for m in run.transcript if m["role"] == "assistant")
    if run.env is None:
        run.state = EpisodeState.TERMINATED
        return
    try:
        result = as_step_result(_outcome(stepped, lambda: run.env.step(run.transcript[-1]["content"])), env_name or "env")
        run.turn_rewards.append(result.reward)
        run.info.update(result.info or {})
        if result.done or result.observation is None:
            run.state = EpisodeState.TERMINATED
            return
        if turns >= limits.max_turns:
            run.status, run.state = "truncated", EpisodeState.TERMINATED
            return
        observation = result.observation if isinstance(result.observation, list) else str(result.observation)
        tokens, parts = chat.observation(observation, last_token=last_token)
    except Exception as exc:  # the env's own fault (a raise, a hostile image): this episode only
        run.fail(f"{env_name}.step (turn {turns})", exc)
        return
    if len(run.tokens) + len(tokens) >= limits.max_episode_tokens:
        run.status, run.state = "truncated", EpisodeState.TERMINATED
        return
    run.append(tokens, sampled=False)
    images += [chat.processor.process(p) for p in parts]
    run.transcript.append({"role": "user", "content": to_parts(observation, "observation")})
    run.state = EpisodeState.GENERATING


def episode_text(episode: Episode) -> str:
    """The transcript's text (images left out): for logs."""
    return "\n".join(f"{m['role']}: {text_of(m['content'])}" for m in episode.transcript)

