"""A VLM update step against a text update step with the same number of tokens, and each one's peak memory.

    PYTHONPATH=$PWD .venv/bin/python bench/vision_step.py --repeats 3

The model is the demo's `smollm2-llava` (SmolLM2-135M + a 2-layer SigLIP tower and projector). The batch: 8
episodes of examples/vision_colours.py's task (a 32 x 32 picture = 16 image tokens, the question, a one-word
answer), LoRA on the language model (`lora_vision="none"`, the default). The text batch is the same token ids
with every image token replaced by an ordinary text token (random, different per row, so that no two rows share
a prompt) and no images: the same sequence lengths, so the difference is the tower, the connector and merging
the features. Each kind runs in its own child process, so its peak RSS
(ru_maxrss) is its own; within it the step runs once to warm up, then `--repeats` times. The time ratio comes from
a third run that alternates the two kinds' steps on one worker (`--repeats` each, medians): on a loaded machine
the load slows both alike.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path


def _batches(worker, rows: int) -> dict:
    """{"text": request, "vlm": request}: the two update requests of the same token ids and lengths."""
    import random

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import vision_colours as demo

    from tinkerless.functions.losses import LossConfig
    from tinkerless.wire.content import image_part
    from tinkerless.wire.messages import Datum, UpdateRequest

    rng = random.Random(0)
    answer = worker.chat.encode("Red.") + [worker.chat.end_of_turn_id]
    # Text stand-ins for the image tokens: ordinary tokens, different per row (identical rows would share their
    # prompt's forward in the update, `training/shared_prefix.py`, which image rows never do).
    fillers = np.random.default_rng(0).integers(1000, 20000, size=(rows, 64))
    data = {"text": [], "vlm": []}
    for row in range(rows):
        task = demo.make_task(rng)
        messages = [{"role": "user", "content": [image_part(task["images"][0]), demo.QUESTION]}]
        prompt, parts = worker.vision.chat.prompt(messages)
        tokens = prompt + answer
        mask = np.asarray([0.0] * len(prompt) + [1.0] * len(answer), np.float32)
        slots = iter(fillers[row])
        text = [int(next(slots)) if t == worker.vision.processor.image_token_id else t for t in tokens]
        data["vlm"].append(Datum(np.asarray(tokens, np.int32), mask, advantages=mask,
                                 images=[worker.vision.processor.process(p) for p in parts]))
        data["text"].append(Datum(np.asarray(text, np.int32), mask, advantages=mask))
    loss = LossConfig(name="cross_entropy", normalization="token")
    return {kind: UpdateRequest("p", batch, loss) for kind, batch in data.items()}


def _worker():
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig

    worker = Worker("smollm2-llava", threads=2)
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=16)))
    return worker


def _run(kind: str, repeats: int, rows: int, queue) -> None:
    """One kind's steps in a process of its own: its peak RSS is its own."""
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    worker = _worker()
    request = _batches(worker, rows)[kind]
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        worker.update(request)
        if i:
            times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put({"kind": kind, "tokens": int(sum(len(d.tokens) for d in request.data)), "rows": rows,
               "step_s": statistics.median(times), "step_s_all": times,
               "peak_rss_gb": peak / 2**20, "rss_over_start_gb": (peak - baseline) / 2**20})


def _interleaved(repeats: int, rows: int) -> dict:
    """Both kinds' steps alternated on one worker: a loaded machine slows both alike (the time ratio's figure)."""
    worker = _worker()
    requests = _batches(worker, rows)
    times = {"text": [], "vlm": []}
    for i in range(repeats + 1):
        for kind in ("text", "vlm") if i % 2 == 0 else ("vlm", "text"):
            started = time.perf_counter()
            worker.update(requests[kind])
            if i:
                times[kind].append(time.perf_counter() - started)
    return {kind: {"step_s": statistics.median(t), "step_s_all": t} for kind, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    results = {}
    for kind in ("text", "vlm"):
        queue = context.Queue()
        child = context.Process(target=_run, args=(kind, args.repeats, args.rows, queue))
        child.start()
        results[kind] = queue.get()
        child.join()
    interleaved = _interleaved(args.repeats, args.rows)
    results["interleaved"] = interleaved
    results["vlm_over_text_time"] = interleaved["vlm"]["step_s"] / interleaved["text"]["step_s"]
    results["vlm_over_text_peak_rss"] = results["vlm"]["peak_rss_gb"] / results["text"]["peak_rss_gb"]
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
