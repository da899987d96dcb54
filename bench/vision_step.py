"""A VLM update step against a text update step with the same number of tokens, and each one's peak memory.

    PYTHONPATH=$PWD .venv/bin/python bench/vision_step.py --repeats 3

The model is the demo's `smollm2-llava` (SmolLM2-135M + a 2-layer SigLIP tower and projector). The batch: 8
episodes of examples/vision_colours.py's task (a 32 x 32 picture = 16 image tokens, the question, a one-word
answer), LoRA on the language model (`lora_vision="none"`, the default). The text batch is the same token ids
with every image token replaced by a text token and no images: the same sequence lengths, so the difference is
the tower, the connector and merging the features. Each kind runs in its own child process, so its peak RSS
(ru_maxrss) is its own; within it the step runs once to warm up, then `--repeats` times (the median is kept).
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


def _run(kind: str, repeats: int, rows: int, queue) -> None:
    import random

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import vision_colours as demo

    from tinkerless.functions.losses import LossConfig
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.content import image_part
    from tinkerless.wire.messages import CreatePolicyRequest, Datum, LoraConfig, UpdateRequest

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    worker = Worker("smollm2-llava", threads=2)
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=16)))
    rng = random.Random(0)
    answer = worker.chat.encode("Red.") + [worker.chat.end_of_turn_id]
    filler = worker.chat.encode(" the")[0]
    data = []
    for _ in range(rows):
        task = demo.make_task(rng)
        messages = [{"role": "user", "content": [image_part(task["images"][0]), demo.QUESTION]}]
        prompt, parts = worker.vision.chat.prompt(messages)
        tokens = prompt + answer
        mask = [0.0] * len(prompt) + [1.0] * len(answer)
        images = [worker.vision.processor.process(p) for p in parts]
        if kind == "text":
            tokens = [filler if t == worker.vision.processor.image_token_id else t for t in tokens]
            images = None
        import numpy as np

        data.append(Datum(np.asarray(tokens, np.int32), np.asarray(mask, np.float32),
                          advantages=np.asarray(mask, np.float32), images=images))
    request = UpdateRequest("p", data, LossConfig(name="cross_entropy", normalization="token"))
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        worker.update(request)
        if i:
            times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put({"kind": kind, "tokens": int(sum(len(d.tokens) for d in data)), "rows": rows,
               "step_s": statistics.median(times), "step_s_all": times,
               "peak_rss_gb": peak / 2**20, "rss_over_start_gb": (peak - baseline) / 2**20})


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
    results["vlm_over_text_time"] = results["vlm"]["step_s"] / results["text"]["step_s"]
    results["vlm_over_text_peak_rss"] = results["vlm"]["peak_rss_gb"] / results["text"]["peak_rss_gb"]
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
