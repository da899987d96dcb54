"""Host memory of the sharded update's ranks: each rank reading only its shard of the base weights, against
every rank loading the whole model (`TINKERLESS_WHOLE_BASE_ON_RANKS=1`, what the ranks did before).

    PYTHONPATH=$PWD .venv/bin/python bench/rank_host_memory.py --out bench/results/rank-host-memory-2c.jsonl

A Llama of about 0.9B parameters (hidden 2048, 16 layers, vocabulary 49152; random weights, saved as fp32
safetensors) on CPU ranks (gloo), its base weights fp32 (as saved: transformers memory-maps them) and bf16 (cast
while loading). For each way of loading and each rank count: the ranks start, a policy is
created (the ranks shard the model and read its weights), one update runs. A thread reads each rank's private
resident memory (RssAnon, /proc: the memory a rank owns) every 20 ms; the figures are its peak while the ranks
load (start and create the policy), what it is once they are ready, and its peak during the update. Pages
of the memory-mapped checkpoint a rank reads count in its VmHWM too, but they are the page cache, one copy shared
by every rank and given back under pressure, so VmHWM would count the file once per rank. The model's fp32 size is
in the table for scale. Rows are appended to `--out` as they
are measured; a markdown table ends the run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded_update import _data, _write  # noqa: E402  (the same update batch, the same rows out)

SHAPE = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
         "intermediate_size": 5632, "vocab_size": 49152}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", default="2", help="rank counts to measure, e.g. 2 or 2,4")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--dtype", default="fp32,bf16", help="the run's base weights (the checkpoint is fp32)")
    parser.add_argument("--out", default="rank_host_memory.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.write_text("")
    header = {"what": "device", "device": f"CPU: {platform.processor() or platform.machine()}", "cpus": os.cpu_count(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    _write(out, header)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tinkerless-rank-memory-") as tmp:
        model_dir, parameters = _build(Path(tmp), args.layers)
        for world, dtype, loading in itertools.product(
                [int(w) for w in args.world_size.split(",")], args.dtype.split(","), ("whole", "shards")):
            row = {"loading": loading, "world_size": world, "dtype": dtype, "parameters": parameters,
                   "fp32_gib": parameters * 4 / 2**30, **_measure(model_dir, world, dtype, whole=loading == "whole")}
            _write(out, row)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(_markdown(header, rows))


def _measure(model_dir: str, world: int, dtype: str, *, whole: bool) -> dict:
    from tinkerless.functions.losses import LossConfig
    from tinkerless.functions.sharding.group import ShardedWorker
    from tinkerless.wire.messages import AdamParams, CreatePolicyRequest, LoraConfig, UpdateRequest

    os.environ["TINKERLESS_WHOLE_BASE_ON_RANKS"] = "1" if whole else "0"  # the spawned ranks inherit it
    began = time.perf_counter()
    group = None
    try:
        with _watching() as loading:  # from before the ranks start: loading the whole model happens as they start
            group = ShardedWorker(model_dir, world_size=world, device="cpu", dtype=dtype, threads=2)
            group.create_policy(CreatePolicyRequest("bench", LoraConfig(rank=16)))
        ready_s = time.perf_counter() - began
        ranks = [p.pid for p in group._procs]
        ready = [_status_kib(pid, "RssAnon") for pid in ranks]
        with _watching() as stepping:
            result = group.update(UpdateRequest("bench", _data(2, 16), LossConfig(), AdamParams(learning_rate=1e-5)))
    finally:
        if group is not None:
            group.close()
        os.environ.pop("TINKERLESS_WHOLE_BASE_ON_RANKS", None)
    gib = 2**20  # KiB in a GiB
    return {"load_peak_gib": [loading[pid] / gib for pid in ranks], "ready_gib": [r / gib for r in ready],
            "update_peak_gib": [stepping[pid] / gib for pid in ranks], "ready_s": ready_s, "loss": result.metrics.get("loss")}


@contextlib.contextmanager
def _watching() -> Iterator[dict[int, int]]:
    """Each child process's peak RssAnon in KiB, by pid, while the block runs (read every 20 ms)."""
    peaks: dict[int, int] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for pid in _children():
                try:
                    peaks[pid] = max(peaks.get(pid, 0), _status_kib(pid, "RssAnon"))
                except (OSError, KeyError):
                    pass
            stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield peaks
    finally:
        stop.set()
        watcher.join()


def _children() -> list[int]:
    pids = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _build(directory: Path, layers: int) -> tuple[str, int]:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tinkerless.functions.models import build_tiny_model

    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, tie_word_embeddings=True, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    tokenizer = build_tiny_model(directory / "tokenizer", hidden_size=64, num_layers=1, seed=0)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(directory)  # the batch is token ids: any tokenizer
    return str(directory), parameters


def _markdown(header: dict, rows: list[dict]) -> str:
    lines = [f"{header['device']} ({header['cpus']} cores), torch {header['torch']}, {header['date']}", "",
             "| ranks | dtype | base weights | parameters | fp32 GiB | private GiB a rank: peak loading | ready "
             "| peak in an update | ready s | loss |", "|---:|---|---|---:|---:|---|---|---|---:|---:|"]
    for r in rows:
        each = {k: ", ".join(f"{v:.2f}" for v in r[k]) for k in ("load_peak_gib", "ready_gib", "update_peak_gib")}
        lines.append(f"| {r['world_size']} | {r['dtype']} | {r['loading']} | {r['parameters'] / 1e9:.2f}B | {r['fp32_gib']:.2f} | "
                     f"{each['load_peak_gib']} | {each['ready_gib']} | {each['update_peak_gib']} | {r['ready_s']:.1f} "
                     f"| {r['loss']:.6f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
