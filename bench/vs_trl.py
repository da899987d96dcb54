"""TRL's GRPOTrainer and tinkerless's local backend on the same RL job, side by side, in one invocation.

    python bench/vs_trl.py                       # SmolLM2, 2 rounds x 6 steps per side, alternating
    python bench/vs_trl.py --model tiny-qwen     # a small Qwen2 built from a config (no hub): for a GPU run
    python bench/vs_trl.py --rounds 1 --steps 3  # quicker

The same job on both sides: the model, prompts (sums of two digits), the reward (1.0 when the first
number is the sum, +0.5 when the answer is only the number), 8 prompts x 4 samples a step, 12 new
tokens, temperature 0.7, learning rate 5e-4, LoRA r16 (alpha 32) on all linear layers, beta 0 (no KL),
one optimizer step per batch, the same torch threads (OMP_NUM_THREADS), no vLLM.

Runs alternate (TRL, tinkerless, TRL, ...) so both see the same machine load. Each run is its own
process; it reports every step's wall time and mean reward, sampled tokens and its peak RSS.
The first step of each run is warm-up and left out of the medians.

TRL runs from a separate venv (`.venv-trl`, created here on first use). That venv reads the project
venv's packages (a .pth file) and adds only what TRL needs on top, so both sides run the very same
torch, transformers and peft. Results: a JSON summary and `vs_trl.png` (reward against wall-clock)
in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
BATCH_PROMPTS, GROUP, NEW_TOKENS, TEMPERATURE, LR, LORA_RANK = 8, 4, 12, 0.7, 5e-4, 16


# ---- the job, shared by both sides ---------------------------------------------------------------


def tasks(seed: int = 0) -> list[dict]:
    """Every a + b with single digits, in a seeded order."""
    pool = [{"prompt": f"What is {a} + {b}? Answer with a number.", "answer": a + b} for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pool)
    return pool


def score(completion: str, answer: int) -> float:
    numbers = re.findall(r"-?\d+", completion)
    if not numbers or int(numbers[0]) != answer:
        return 0.0
    return 1.0 + (0.5 if completion.strip().rstrip(".") == str(answer) else 0.0)


def resolve(model: str) -> str:
    from tinkerless.functions.models import build_tiny_model, cache_dir, resolve_model

    if model == "tiny-qwen":  # ~9 M parameters, random: for timing on a GPU, it learns nothing useful
        return build_tiny_model(cache_dir() / "models" / "tiny-qwen2-h256-l4-s0", hidden_size=256, num_layers=4)
    return resolve_model(model)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ---- tinkerless side ------------------------------------------------------------------------------


def run_tinkerless(args) -> dict:
    import tinkerless

    @tinkerless.reward
    def sums(completion: str, task: dict) -> float:
        return score(completion, task["answer"])

    cpu = time.process_time()
    result = tinkerless.train(
        model=args.model_path, reward=sums, tasks=tasks(args.seed), steps=args.steps, batch_size=BATCH_PROMPTS,
        group_size=GROUP, max_tokens=NEW_TOKENS, temperature=TEMPERATURE, learning_rate=LR, lora_rank=LORA_RANK,
        kl_coef=0.0, checkpoint_every=args.steps, progress=False, seed=args.seed, storage=args.storage,
        run_id=f"vs-trl-{args.run_index}",
    )  # fmt: skip
    steps = [
        {"s": r["step_s"], "reward": r["reward_mean"], "sampled_tokens": r["sampled_tokens"], "rollout_s": r["rollout_s"],
         "update_s": r["update_s"], "storage_s": r["storage_s"]}
        for r in result.metrics
    ]  # fmt: skip
    return {"steps": steps, "cpu_s": time.process_time() - cpu}


# ---- TRL side ---------------------------------------------------------------------------------------


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [{"prompt": [{"role": "user", "content": t["prompt"]}], "answer": t["answer"]} for t in tasks(args.seed)]
    dataset = Dataset.from_list(rows * (1 + args.steps * BATCH_PROMPTS // len(rows)))

    def sums(prompts, completions, answer, **_):
        return [score(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.started = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            steps.append({"s": time.perf_counter() - self.started})

        def on_log(self, _args, _state, _control, logs=None, **_k):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = float(logs["reward"])
                steps[-1]["sampled_tokens"] = float(logs.get("completions/mean_length", 0.0)) * BATCH_PROMPTS * GROUP

    config = GRPOConfig(
        output_dir=args.storage, per_device_train_batch_size=BATCH_PROMPTS * GROUP, num_generations=GROUP,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_completion_length=NEW_TOKENS,
        temperature=TEMPERATURE, learning_rate=LR, beta=0.0, use_vllm=False, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(), bf16=False,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model, reward_funcs=[sums], args=config, train_dataset=dataset, processing_class=tokenizer,
        peft_config=peft_config, callbacks=[Clock()],
    )  # fmt: skip
    cpu = time.process_time()
    trainer.train()
    return {"steps": steps, "cpu_s": time.process_time() - cpu}


# ---- driver -------------------------------------------------------------------------------------------


def trl_python(venv: Path) -> str:
    """The TRL venv's interpreter, creating the venv on first use (PyPI: trl and what it adds).

    Where this interpreter already has TRL at that version (a GPU machine with no package index, where
    the wheels were installed beside the project's), it runs both sides."""
    try:
        import trl

        if trl.__version__ == TRL_VERSION:
            return sys.executable
    except ImportError:
        pass
    python = venv / "bin" / "python"
    try:
        subprocess.run([str(python), "-c", f"import trl; assert trl.__version__ == {TRL_VERSION!r}"], check=True, capture_output=True)
        return str(python)
    except (OSError, subprocess.CalledProcessError):
        pass
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    # Read this venv's packages after the TRL venv's own: the same torch/transformers/peft on both sides.
    Path(site, "zz-project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"trl=={TRL_VERSION}"], check=True)
    return str(python)


def child_main(args) -> None:
    started = time.perf_counter()
    out = run_trl(args) if args.side == "trl" else run_tinkerless(args)
    out.update(side=args.side, run_index=args.run_index, peak_rss_gb=round(peak_rss_gb(), 2), total_s=time.perf_counter() - started)
    import torch
    import transformers

    out["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    if args.side == "trl":
        import trl

        out["versions"]["trl"] = trl.__version__
    Path(args.result).write_text(json.dumps(out))


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for side in ("trl", "tinkerless"):
        own = [r for r in runs if r["side"] == side]
        warm = [s for r in own for s in r["steps"][1:]]  # step 0 of each run is warm-up
        if not warm:
            continue
        summary[side] = {
            "median_s_per_step": statistics.median(s["s"] for s in warm),
            "sampled_tokens_per_s": sum(s.get("sampled_tokens", 0.0) for s in warm) / sum(s["s"] for s in warm),
            "peak_rss_gb": max(r["peak_rss_gb"] for r in own),
            # Process CPU seconds per step, warm-up step included (both sides alike; tinkerless's also counts its model
            # load, TRL's does not): far less inflated than wall
            # time when other jobs share the cores, so it checks the wall ratio on a loaded machine.
            "cpu_s_per_step": statistics.mean(r["cpu_s"] / len(r["steps"]) for r in own if "cpu_s" in r),
            "runs": len(own),
            "versions": own[0].get("versions"),
        }
    if "trl" in summary and "tinkerless" in summary:
        summary["ratio_s_per_step"] = summary["tinkerless"]["median_s_per_step"] / summary["trl"]["median_s_per_step"]
        summary["ratio_cpu_s_per_step"] = summary["tinkerless"]["cpu_s_per_step"] / summary["trl"]["cpu_s_per_step"]
        summary["reward_at_equal_wall_clock"] = equal_time_rewards(runs)
    return summary


def curve(run: dict) -> tuple[list[float], list[float]]:
    t, xs, ys = 0.0, [], []
    for s in run["steps"]:
        t += s["s"]
        if s.get("reward") is not None:
            xs.append(t)
            ys.append(s["reward"])
    return xs, ys


def equal_time_rewards(runs: list[dict]) -> dict:
    """Each side's mean reward over its last 3 steps finished by the time the quicker side's runs took in total
    (runs of a side averaged): the reward each gets for the same wall-clock. None: no step finished by then."""
    horizon = min(max(curve(r)[0][-1] for r in runs if r["side"] == side) for side in ("trl", "tinkerless"))
    out = {"seconds": horizon}
    for side in ("trl", "tinkerless"):
        values = []
        for run in (r for r in runs if r["side"] == side):
            xs, ys = curve(run)
            done = [y for x, y in zip(xs, ys) if x <= horizon + 1e-9]
            if done:  # a run that finished no step by then has no reward yet
                values.append(statistics.mean(done[-3:]))
        out[side] = statistics.mean(values) if values else None
    return out


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"trl": "tab:orange", "tinkerless": "tab:blue"}
    for run in runs:
        xs, ys = curve(run)
        label = f"{run['side']} (run {run['run_index']})"
        ax.plot(xs, ys, marker="o", color=colors[run["side"]], alpha=0.5 + 0.5 / (1 + run["run_index"] // 2), label=label)
    ax.set_xlabel("wall-clock seconds of training (model load excluded)")
    ax.set_ylabel("mean reward per step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (the converted local copy) or tiny-qwen")
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads on both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/vs_trl")
    parser.add_argument("--trl-venv", default=str(REPO / ".venv-trl"))
    parser.add_argument("--sides", default="trl,tinkerless", help="which sides to run (in this order per round)")
    # child-process options
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--run-index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child_main(args)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve(args.model)
    sides = args.sides.split(",")
    pythons = {"tinkerless": sys.executable}
    if "trl" in sides:
        pythons["trl"] = trl_python(Path(args.trl_venv))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}  # fmt: skip
    runs = []
    index = 0
    for _ in range(args.rounds):
        for side in sides:
            result = out / f"run-{index}-{side}.json"
            command = [pythons[side], __file__, "--side", side, "--model-path", model_path, "--steps", str(args.steps),
                       "--seed", str(args.seed + index // len(sides)), "--storage", str(out / f"storage-{index}"),
                       "--result", str(result), "--run-index", str(index)]  # fmt: skip
            print(f"run {index}: {side} ...", flush=True)
            proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"the {side} run failed (exit {proc.returncode})")
            run = json.loads(result.read_text())
            runs.append(run)
            print(f"  {side}: steps {[round(s['s'], 1) for s in run['steps']]} s, rewards "
                  f"{[round(s.get('reward', float('nan')), 2) for s in run['steps']]}, peak RSS {run['peak_rss_gb']} GB", flush=True)  # fmt: skip
            index += 1
    summary = summarize(runs)
    summary.update(model=args.model, steps=args.steps, rounds=args.rounds, threads=args.threads, machine=machine())
    (out / "summary.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    plot(runs, out / "vs_trl.png", f"{args.model}: TRL GRPOTrainer vs tinkerless (8x4, 12 tokens, {device_label()})")
    print(json.dumps(summary, indent=1))
    print(f"plot: {out / 'vs_trl.png'}")


def device_label() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def machine() -> str:
    import platform

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.machine()} {cpu}, {os.cpu_count()} cores, {device_label()}, load average {os.getloadavg()[0]:.1f} at the end"


if __name__ == "__main__":
    main()
