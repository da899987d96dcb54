"""Multi-turn rollouts with and without KV caches kept across turns, against the single-turn main job.

    PYTHONPATH=. .venv/bin/python bench/multiturn.py [--steps 5] [--model smollm2] [--batch-size 8 --group-size 4]

Trains on the local backend, one process per example (peak RSS is a per-process high-water mark):
the main job (examples/arithmetic.py, single-turn), guess_number and gomoku_vs_random. In the
multi-turn runs the steps alternate the cache off (`TINKERLESS_KV_CACHE=0`'s switch: every turn
re-prefills the whole conversation, the "before") and on (the "after"), after a first warm-up step
that is not counted: on a machine shared with other work, both modes then see the same load.
`--separate` runs each mode in a process of its own instead (peak RSS per mode, load not shared).

guess_number runs at the main job's batch (`--batch-size` tasks x `--group-size` samples, the
main job's 8 x 4 by default); gomoku keeps its own 2 x 4 games (its RSS target is for that
config; `--gomoku-batch same` overrides) and the main job runs at that batch too, to compare.
Prints, per example and mode: the rollout's sampled tokens/s, seconds per step and per rollout
(medians over that mode's steps), the prompt tokens prefilled, reused from kept caches and the
tokens decoded per rollout, the process's peak RSS, and each multi-turn tokens/s as a fraction
of the main job's at the same batch (target: at least 0.70), with the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

EXAMPLES = {
    "main job (arithmetic)": REPO / "examples/arithmetic.py",
    "guess_number": REPO / "examples/guess_number.py",
    "gomoku_vs_random": REPO / "examples/gomoku_vs_random.py",
}
SINGLE_TURN = "main job (arithmetic)"


def run_child(args: argparse.Namespace) -> None:
    """One training run in this process; prints one RESULT line of JSON per cache mode."""
    import tinkerless
    from tinkerless.sdk.backends.base import LocalBackend
    from tinkerless.sdk.cli.commands import load_config

    overrides = dict(model=args.model, steps=args.steps, progress=False, checkpoint_every=10**6)
    if args.batch_size:
        overrides.update(batch_size=args.batch_size, group_size=args.group_size)
    config = load_config(str(EXAMPLES[args.child])).replace(**overrides)
    backend = LocalBackend(args.model)
    worker = backend.worker
    store = worker.engine.sessions
    calls: list[dict] = []
    for method in ("rollout", "rollout_multi"):  # each step's rollout: its cache mode and its own stats
        def counted(request, _real=getattr(worker, method)):
            if args.mode == "interleaved":  # the warm-up step with the cache on, then off, on, off, ...
                store.enabled = not calls or len(calls) % 2 == 0
            result = _real(request)
            calls.append({"cache": store.enabled, **result.stats})
            return result
        setattr(worker, method, counted)
    started = time.perf_counter()
    if args.child == "gomoku_vs_random" and not args.train_gomoku:
        metrics = rollouts_only(config, worker)
    else:
        with tempfile.TemporaryDirectory(prefix="tinkerless-multiturn-") as storage:
            metrics = tinkerless.train(config, backend=backend, storage=storage, run_id="bench").metrics
    wall = time.perf_counter() - started
    if len(calls) != len(metrics):
        sys.exit(f"{len(calls)} rollout calls for {len(metrics)} steps: cannot tell the steps' modes apart")
    measured = list(zip(metrics, calls))[1:]  # the first step warms up
    for cache in sorted({call["cache"] for _, call in measured}):
        steps = [(m, c) for m, c in measured if c["cache"] == cache]

        def median(key, source="metrics"):
            return statistics.median([(m if source == "metrics" else c).get(key, 0.0) for m, c in steps])

        print("RESULT " + json.dumps({
            "example": args.child, "cache": cache, "steps": len(steps), "batch": f"{config.batch_size} x {config.group_size}",
            "tokens_per_s": median("tokens_per_s"), "step_s": median("step_s") if "step_s" in steps[0][0] else float("nan"),
            "rollout_s": median("rollout_s"),
            "turns_mean": median("turns_mean"),
            "prefill_tokens": median("prefill_tokens", "calls"), "cached_prompt_tokens": median("cached_prompt_tokens", "calls"),
            "decoded_tokens": median("decoded_tokens", "calls"),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "rewards": [round(m["reward_mean"], 3) for m, _ in steps], "wall_s": wall, "threads": worker.threads.threads,
            "trained": "step_s" in steps[0][0],
        }), flush=True)


def rollouts_only(config, worker) -> list[dict]:
    """The training run's rollouts (its policy, tasks, seeds and seats) without the updates: per step, the
    metrics a step record has of its rollout. For gomoku on a machine without memory for its update
    (before the update's T x T memory is gone, about 15 GB)."""
    run = RolloutOnly(config, worker)
    return [run.step(step) for step in range(config.steps)]


class RolloutOnly:
    """Rollouts of one example as its training run makes them (policy, tasks, seeds, seats), without updates."""

    def __init__(self, config, worker):
        import random

        from tinkerless.sdk.run.multi_agent import build_seats
        from tinkerless.wire import pack_code
        from tinkerless.wire.messages import CreatePolicyRequest, EpisodeLimits, LoraConfig, SamplingParams

        self.config, self.worker = config, worker
        self.env = pack_code(config.env, name=getattr(config.env, "__qualname__", None)) if config.env else None
        self.reward = pack_code(config.reward, name=getattr(config.reward, "__qualname__", None)) if config.reward else None
        self.seat_list = build_seats(config.agents) if config.agents else None
        policies = {s.policy for seats in self.seat_list or [] for s in seats.values() if s.trainable and s.policy}
        self.policy = "default"
        for i, policy in enumerate(sorted(policies) or [self.policy]):
            if policy not in worker.policies:
                worker.create_policy(CreatePolicyRequest(policy, LoraConfig(rank=config.lora_rank, alpha=config.lora_alpha,
                                                                            seed=config.seed + i)))
        self.rng = random.Random(config.seed)
        self.sampling = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p)
        self.limits = EpisodeLimits(max_turns=config.turn_limit(), max_episode_tokens=config.max_episode_tokens)

    def step(self, step: int) -> dict:
        import math

        from tinkerless.wire.messages import MultiAgentRolloutRequest, RolloutRequest

        config, worker = self.config, self.worker
        tasks = [config.tasks(self.rng) for _ in range(config.batch_size)]
        seed = (config.seed * 1_000_003 + step * 7919) % (2**31 - 1)
        started = time.perf_counter()
        if self.seat_list:
            episodes = [e for index, seats in enumerate(self.seat_list) for e in worker.rollout_multi(MultiAgentRolloutRequest(
                tasks=tasks, group_size=config.group_size, env=self.env, seats=seats, sampling=self.sampling,
                limits=self.limits, seed=seed + index, protocol_timeout=config.protocol_timeout)).episodes]
        else:
            episodes = worker.rollout(RolloutRequest(
                policy=self.policy, tasks=tasks, group_size=config.group_size, sampling=self.sampling, limits=self.limits,
                seed=seed, env=self.env, reward=self.reward, system_prompt=config.system_prompt)).episodes
        seconds = time.perf_counter() - started
        sampled = float(sum(e.mask.sum() for e in episodes))
        rewards = [e.reward for e in episodes if e.status != "error" and e.info.get("trainable", True)]
        return {"tokens_per_s": sampled / seconds, "rollout_s": seconds, "sampled_tokens": sampled,
                "turns_mean": statistics.mean([e.num_turns for e in episodes]),
                "reward_mean": statistics.mean(rewards) if rewards else math.nan}


def compare_rollouts(args: argparse.Namespace) -> None:
    """The main job's rollout, then guess_number's with the cache off and on, round after round in one process
    on one worker (so all three see the same load); the first round warms up. Rollouts only, same batch."""
    from tinkerless.functions.worker import Worker
    from tinkerless.sdk.cli.commands import load_config

    worker = Worker(args.model)
    runs = {}
    for name in (SINGLE_TURN, "guess_number"):
        config = load_config(str(EXAMPLES[name])).replace(model=args.model, batch_size=args.batch_size,
                                                          group_size=args.group_size)
        runs[name] = RolloutOnly(config, worker)
    seen: dict[tuple[str, bool], list[float]] = {}
    for round_index in range(args.compare_rollouts + 1):
        modes = ((SINGLE_TURN, True),) + ((("guess_number", False),) if args.uncached else ()) + (("guess_number", True),)
        for name, cache in modes:
            worker.engine.sessions.enabled = cache
            result = runs[name].step(round_index)
            if round_index:
                seen.setdefault((name, cache), []).append(result["tokens_per_s"])
    single = statistics.median(seen[(SINGLE_TURN, True)])
    print(f"model {args.model}, rollouts only, batch {args.batch_size} x {args.group_size}, {args.compare_rollouts} rounds "
          f"after a warm-up round, load average {os.getloadavg()[0]:.1f}, torch threads {worker.threads.threads}")
    print("| rollout | KV cache across turns | tok/s per round | median | vs main job |")
    print("|---|---|---|---|---|")
    for (name, cache), values in seen.items():
        mode = "-" if name == SINGLE_TURN else ("on" if cache else "off")
        print(f"| {name} | {mode} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} | "
              f"{statistics.median(values) / single:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per run, the first a warm-up (odd: as many off as on)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--gomoku-batch", default="own", help="'own' (its config's 2 x 4 games: the RSS target's) or 'same'")
    parser.add_argument("--separate", action="store_true", help="each cache mode in a process of its own")
    parser.add_argument("--train-gomoku", action="store_true",
                        help="train gomoku (its update needs ~15 GB before T x T attention memory is gone); default: its rollouts only")
    parser.add_argument("--only", nargs="*", default=list(EXAMPLES), help="examples to run (names as printed)")
    parser.add_argument("--compare-rollouts", type=int, metavar="ROUNDS",
                        help="only rollouts: the main job's and guess_number's (cache off, on) in turn, ROUNDS rounds, one process")
    parser.add_argument("--no-uncached", dest="uncached", action="store_false",
                        help="with --compare-rollouts: skip guess_number with the cache off (only the main job's and cached)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="interleaved", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    if args.compare_rollouts:
        compare_rollouts(args)
        return
    from tinkerless.sdk.cli.commands import load_config

    same = (args.batch_size, args.group_size)
    own = load_config(str(EXAMPLES["gomoku_vs_random"]))
    gomoku = same if args.gomoku_batch == "same" else (own.batch_size, own.group_size)
    multi_modes = ("off", "on") if args.separate else ("interleaved",)
    runs = [(name, mode, gomoku if name == "gomoku_vs_random" else same) for name in args.only
            for mode in (("on",) if name == SINGLE_TURN else multi_modes)]
    if "gomoku_vs_random" in args.only and gomoku != same and SINGLE_TURN in args.only:
        runs.append((SINGLE_TURN, "on", gomoku))
    results, loads = [], []
    for name, mode, batch in runs:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if mode == "off":
            env["TINKERLESS_KV_CACHE"] = "0"
        command = [sys.executable, __file__, "--child", name, "--mode", mode, "--steps", str(args.steps),
                   "--model", args.model, "--batch-size", str(batch[0]), "--group-size", str(batch[1])]
        command += ["--train-gomoku"] if args.train_gomoku else []
        loads.append(os.getloadavg()[0])
        out = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            sys.exit(f"{name} ({mode}) failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        for line in lines:
            results.append(json.loads(line[len("RESULT "):]))
            r = results[-1]
            print(f"done: {name}, cache {'on' if r['cache'] else 'off'}: {r['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    loads.append(os.getloadavg()[0])
    print(f"model {args.model}, {args.steps} steps per run (the first a warm-up), cache modes "
          f"{'in separate processes' if args.separate else 'alternating step by step in one process'}, "
          f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs, torch threads {results[0]['threads']}")
    single = {r["batch"]: r["tokens_per_s"] for r in results if r["example"] == SINGLE_TURN}
    print("| example | batch (tasks x samples) | KV cache across turns | steps | rollout tok/s | vs main job, same batch | "
          "s/step | rollout s/step | turns | prefilled / cached / decoded tokens per rollout | peak RSS GB | rewards |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['tokens_per_s'] / single[r['batch']]:.2f}" if r["batch"] in single else "-"
        mode = "-" if r["example"] == SINGLE_TURN else ("on" if r["cache"] else "off")
        step_s = f"{r['step_s']:.1f}" if r.get("trained", True) else "(rollouts only)"
        print(f"| {r['example']} | {r['batch']} | {mode} | {r['steps']} | {r['tokens_per_s']:.1f} | {ratio} | {step_s} | "
              f"{r['rollout_s']:.1f} | {r['turns_mean']:.1f} | {r['prefill_tokens']:.0f} / {r['cached_prompt_tokens']:.0f} / "
              f"{r['decoded_tokens']:.0f} | {r['peak_rss_gb']:.2f} | {r['rewards']} |")


if __name__ == "__main__":
    main()
