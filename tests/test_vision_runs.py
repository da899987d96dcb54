"""Whole vision-language runs on a tiny random LLaVA-style model: a run killed with SIGKILL and resumed ends with
the adapter of an uninterrupted one, and its export loads in plain transformers + peft and samples the worker's
greedy tokens for an image prompt."""

from __future__ import annotations

import json
import signal
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import train_in_subprocess as _train, latest_checkpoint_step as _latest
import torch
from safetensors.torch import load as load_safetensors

STEPS = 4


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    from tinkerless.functions.vision.models import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("vlm") / "llava", initializer_range=0.2)


@pytest.fixture(scope="module")
def example(llava, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("example") / "see.py"
    path.write_text(textwrap.dedent(f"""
        import time
        import numpy as np
        import tinkerless

        def task(rng):
            shade = rng.randint(0, 255)
            return {{"prompt": "how bright?", "images": [np.full((20, 24, 3), shade, np.uint8)], "shade": shade}}

        @tinkerless.reward
        def bright(completion, task):
            time.sleep(0.05)  # keeps each step long enough to be killed inside it
            # Varies a lot on a tiny random model's byte soup, so every group has a learning signal.
            return sum(c.isascii() for c in completion) / max(len(completion), 1) * (1 + task["shade"]) / 256

        config = tinkerless.TrainConfig(
            name="see", model={llava!r}, reward=bright, tasks=task, steps={STEPS}, batch_size=2, group_size=4,
            max_tokens=6, temperature=1.0, learning_rate=1e-2, checkpoint_every=1, keep_checkpoints=None, seed=7,
            lora_vision="connector", threads=1, progress=False,
        )
        """))
    return path


def _config(example: Path, storage: Path, **changes):
    """The example's config, run in this process (threads=1, as its subprocess runs)."""
    import runpy

    config = runpy.run_path(str(example))["config"]
    return config.replace(storage=str(storage), run_id="r", **changes)


def _adapter(storage: Path, step: int = STEPS) -> dict:
    data = (storage / "runs/r/checkpoints" / f"step-{step}" / "adapter/adapter_model.safetensors").read_bytes()
    return load_safetensors(data)


@pytest.fixture(scope="module")
def straight(example, tmp_path_factory) -> Path:
    """The uninterrupted run, in this process (one thread, as the killed run's subprocess)."""
    from tinkerless.sdk.run.trainer import train

    storage = tmp_path_factory.mktemp("straight")
    train(_config(example, storage))
    return storage


def test_a_killed_and_resumed_vlm_run_ends_with_the_uninterrupted_adapter(example, straight, tmp_path):
    killed = tmp_path / "killed"
    proc = _train(example, killed, wait=False)
    deadline = time.monotonic() + 300
    while _latest(killed) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 2 <= _latest(killed) < STEPS
    from tinkerless.sdk.run.trainer import train

    train(_config(example, killed, resume=True))  # resumed in this process: the same code as the CLI's --resume
    expected, actual = _adapter(straight), _adapter(killed)
    assert expected.keys() == actual.keys() and any("multi_modal_projector" in k for k in expected)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after resume"
    moved = [n for n in expected if not torch.equal(_adapter(straight, 1)[n], expected[n])]
    assert len(moved) == len(expected), "every LoRA tensor trains after step 1"
    # episodes.jsonl refers to the images by hash, never their pixels.
    lines = (straight / "runs/r/episodes.jsonl").read_text().splitlines()
    assert lines and all(len(line) < 20_000 for line in lines)
    assert all("sha256" in json.dumps(json.loads(line)["task"]) for line in lines)


def _prompt(llava: str):
    """An image prompt rendered by plain transformers: the template's one <image>, expanded as the model's own
    processor does (LlavaProcessor with the saved image processor and tokenizer)."""
    from transformers import AutoTokenizer, LlavaProcessor

    from tinkerless.functions.vision.models import load_image_processor

    tokenizer = AutoTokenizer.from_pretrained(llava)
    image = np.full((20, 24, 3), 200, np.uint8)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how bright?"}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    processor = LlavaProcessor(image_processor=load_image_processor(llava), tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="full", chat_template=tokenizer.chat_template)
    from PIL import Image

    inputs = processor(images=[Image.fromarray(image)], text=[text], return_tensors="pt")
    return image, inputs


def test_export_loads_in_plain_transformers_and_peft_and_samples_the_workers_greedy_tokens(llava, straight, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    import tinkerless
    from tinkerless.sdk.backends.base import LocalBackend
    from tinkerless.sdk.evaluation.evaluate import load_checkpoint
    from tinkerless.functions.vision.sampler import VisionPrompt
    from tinkerless.wire.content import image_part
    from tinkerless.wire.messages import SamplingParams

    image, inputs = _prompt(llava)
    backend = LocalBackend(llava)
    assert load_checkpoint(backend, tinkerless.TrainConfig(model=llava, storage=str(straight)), "r", STEPS) == STEPS
    worker = backend.worker
    tokens, parts = worker.vision.chat.prompt([{"role": "user", "content": [image_part(image), "how bright?"]}])
    assert tokens == inputs["input_ids"][0].tolist()  # the worker renders as the model's own processor does
    greedy = worker.vision.sampler.generate(
        [VisionPrompt(tokens, [worker.vision.processor.process(p) for p in parts])],
        SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[]), policy="default", seed=0)[0].tokens

    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    tinkerless.export("r@latest", adapter_dir, storage=str(straight))
    tinkerless.export("r@latest", merged_dir, storage=str(straight), merged=True)
    for model in (PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(llava), adapter_dir),
                  AutoModelForImageTextToText.from_pretrained(merged_dir)):
        model.eval()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=worker.tokenizer.pad_token_id, min_new_tokens=8)
        assert out[0, inputs["input_ids"].shape[1]:].tolist() == greedy


@pytest.mark.filterwarnings("ignore:The .* function is executing locally:UserWarning")
def test_a_vlm_run_through_modals_local_functions_equals_the_local_backend(llava, example, straight, tmp_path):
    """The Modal backend's Rollout / Forward / Update class bodies run through `.local()` (the fake of
    tests/test_modal.py for Modal's network boundary): the same metrics and adapter as the local backend's run."""
    pytest.importorskip("modal")
    from test_modal import _LocalClasses

    from tinkerless.cloud import modal_app
    from tinkerless.cloud.modal_backend import ModalBackend
    from tinkerless.cloud.modal_config import ModalConfig
    from tinkerless.sdk.run.trainer import train

    built = modal_app.build_app(ModalConfig())
    fakes = {role: _LocalClasses(built.classes[role]) for role in ("rollout", "forward", "update")}
    backend = ModalBackend(llava, fakes, ModalConfig(), state_dir=str(tmp_path / "volume"), volume="",
                           engine="auto", micro_batch_size=16, threads=1)
    got = train(_config(Path(example), tmp_path / "modal"), backend=backend)
    expected = [json.loads(line) for line in (straight / "runs/r/metrics.jsonl").read_text().splitlines()]
    for key in ("reward_mean", "loss", "sampled_tokens", "grad_norm", "logprob_gap"):
        assert [m.get(key) for m in got.metrics] == [m.get(key) for m in expected], key
    assert all(m["logprob_gap"] < 1e-4 for m in got.metrics if m.get("logprob_gap") is not None)
    for name, tensor in _adapter(straight).items():
        assert torch.equal(tensor, _adapter(tmp_path / "modal")[name]), name


def test_tinkerless_sft_on_chat_jsonl_with_image_parts(llava, tmp_path):
    """`tinkerless sft` on chat JSONL whose user turns hold data-URL images: the run trains (its NLL falls), and
    the image tokens weigh 0 in every rendered example."""
    import base64
    import io

    from PIL import Image

    from tinkerless.functions.vision.processing import load_processor
    from tinkerless.functions.rollout.chat import ChatFormat
    from tinkerless.sdk.cli.commands import main
    from tinkerless.sdk.sft.data import ChatRenderer, to_messages
    from transformers import AutoTokenizer

    def url(shade: int) -> str:
        buffer = io.BytesIO()
        Image.fromarray(np.full((16, 16, 3), shade, np.uint8)).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    records = [{"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(shade)}},
                                     {"type": "text", "text": "dark or light?"}]},
        {"role": "assistant", "content": "dark" if shade < 128 else "light"}]} for shade in (10, 40, 200, 240)]
    data = tmp_path / "images.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["sft", str(data), "--model", llava, "--steps", "4", "--batch-size", "4", "--learning-rate", "2e-2",
                 "--storage", str(tmp_path), "--run-id", "s", "--no-progress", "--lora-vision", "connector",
                 "--eval-every", "4"]) in (0, None)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "runs/s/metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0], losses
    tokenizer = AutoTokenizer.from_pretrained(llava)
    renderer = ChatRenderer(tokenizer, ChatFormat(tokenizer).end_of_turn_id, load_processor(llava))
    example = renderer.render(to_messages(records[0], "line 1"), "line 1", 1)
    at_images = example.tokens == renderer.vision.image_token_id
    assert at_images.sum() == 16 and (example.weights[at_images] == 0).all() and example.weights.sum() > 0


def test_tinkerless_eval_of_a_vlm_checkpoint_plays_its_image_tasks_and_writes_images_by_hash(example, straight, tmp_path,
                                                                                            capsys):
    """`tinkerless eval` on a VLM run's checkpoint: the held-out tasks carry images, each episode is sampled with
    them, and the transcripts name each image by its hash instead of inlining its bytes."""
    import json

    from tinkerless.sdk.cli.commands import main

    out = tmp_path / "episodes.jsonl"
    assert main(["eval", str(example), "--storage", str(straight), "--checkpoint", f"r@{STEPS}", "--tasks", "3",
                 "--samples", "2", "--transcripts", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["step"] == STEPS and report["episodes"] == 6
    lines = out.read_text().splitlines()
    assert len(lines) == 6 and all(len(line) < 20_000 for line in lines)  # a 20 x 24 picture is never inlined
    records = [json.loads(line) for line in lines]
    assert all(r["status"] == "ok" and r["tokens"]["sampled"] > 0 for r in records)
    for record in records:  # the prompt's picture, by its hash, in the user's turn
        parts = record["messages"][0]["content"]
        image = next(p for p in parts if p["type"] == "image")
        assert len(image["sha256"]) == 64 and "data" not in image and "url" not in image
