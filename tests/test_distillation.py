"""On-policy distillation end to end on tiny models: the advantages the update trains on are the teacher's
log-prob minus the sampler's, token for token (zero when the teacher is the student), mixed with the reward's
group advantage by `distill_coef`; a killed and resumed OPD run ends with the uninterrupted run's adapter."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_resumable_example, latest_checkpoint_step as _latest
from safetensors.torch import load as load_safetensors

import tinkerless
from tinkerless.errors import ConfigError, UserError
from tinkerless.functions.models import build_tiny_model
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.wire import decode_message
from tinkerless.wire.messages import UpdateRequest

CLI = [sys.executable, "-m", "tinkerless.sdk.cli.commands"]


def _task(rng):
    return {"prompt": "say " + str(rng.randint(0, 99))}


@tinkerless.reward
def vowels(completion, task):
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)


SETTINGS = dict(tasks=_task, batch_size=2, group_size=4, max_tokens=8, temperature=1.0, learning_rate=1e-2,
                checkpoint_every=1, progress=False, transcripts_per_step=0)


class Recording(LocalBackend):
    """The local backend, keeping a copy of every update request it runs (what the policy trained on)."""

    def __init__(self, model: str):
        super().__init__(model)
        self.updates: list[UpdateRequest] = []

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        if method == "update":
            self.updates.append(decode_message(payload))
        return super().call_bytes(method, payload)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A model that visibly learns, and a teacher: two RL steps of it, checkpointed as run T."""
    root = tmp_path_factory.mktemp("opd")
    model = build_tiny_model(root / "model", hidden_size=64, num_layers=2, seed=0, initializer_range=0.2)
    storage = root / "storage"
    tinkerless.train(model=model, reward=vowels, run_id="T", steps=2, storage=str(storage), **SETTINGS)
    return model, storage


def _teacher_logprobs_by_hand(model: str, storage: Path, step: int, tokens: np.ndarray) -> np.ndarray:
    """log softmax of the teacher's logits (base + T's adapter at `step`), read straight from its files."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = storage / "runs/T/checkpoints" / f"step-{step}" / "adapter"
    net = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), str(adapter))
    with torch.no_grad():
        logits = net(input_ids=torch.as_tensor(tokens, dtype=torch.long)[None]).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    out = np.zeros(len(tokens))
    out[1:] = logprobs[torch.arange(len(tokens) - 1), torch.as_tensor(tokens[1:], dtype=torch.long)].numpy()
    return out


def test_a_teacher_equal_to_the_student_gives_zero_advantages(setup, tmp_path):
    model, storage = setup
    for teacher, init_from in (("T@2", "T@2"), ("base", None), (model, None)):
        backend = Recording(model)
        result = tinkerless.train(model=model, teacher=teacher, init_from=init_from, steps=1, backend=backend,
                                  storage=str(storage), **SETTINGS)
        data = [d for update in backend.updates for d in update.data]
        assert data, "every sampled token trains under distillation"
        for datum in data:
            on = datum.mask > 0
            assert on.sum() > 0
            np.testing.assert_allclose(datum.advantages[on], 0.0, atol=2e-5)
        assert abs(result.metrics[0]["teacher_logprob_gap"]) < 2e-5
        assert result.metrics[0]["teacher_aligned_share"] == 1.0


def test_a_different_teacher_gives_the_log_prob_difference_computed_by_hand(setup):
    model, storage = setup
    for coef, reward in ((1.0, None), (0.5, vowels)):
        backend = Recording(model)
        result = tinkerless.train(model=model, teacher="T@2", reward=reward, distill_coef=coef, steps=1,
                                  backend=backend, storage=str(storage), **SETTINGS)
        episodes = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
        data = [d for update in backend.updates for d in update.data]
        assert len(data) == SETTINGS["batch_size"] * SETTINGS["group_size"]  # no episode is dropped
        gaps = []
        for datum in data:
            on = datum.mask > 0
            teacher = _teacher_logprobs_by_hand(model, storage, 2, datum.tokens)
            difference = teacher[on] - datum.sampler_logprobs[on]
            # The reward's group advantage is one number per episode: what is left after the teacher's term.
            rest = datum.advantages[on] - coef * difference
            np.testing.assert_allclose(rest, rest[0], atol=5e-5)
            if reward is None:
                np.testing.assert_allclose(rest, 0.0, atol=5e-5)
            assert np.abs(difference).max() > 1e-3, "the teacher must differ from the student for this test to say anything"
            gaps.extend(-difference)
        assert episodes["teacher_logprob_gap"] == pytest.approx(float(np.mean(gaps)), abs=1e-4)
        assert result.usage["compute_seconds"]["teacher"] > 0  # the teacher's own line in the accounting


def test_teacher_settings_are_checked_before_anything_loads(setup):
    model, storage = setup
    for bad in ("", "   ", 3, "T@x", "T@-1"):
        with pytest.raises(ConfigError):
            tinkerless.TrainConfig(model=model, tasks=[{"prompt": "x"}], teacher=bad).validate()
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ConfigError):
            tinkerless.TrainConfig(model=model, tasks=[{"prompt": "x"}], teacher="base", distill_coef=bad).validate()
    with pytest.raises(UserError, match="does not exist"):
        tinkerless.train(model=model, teacher="nope@1", steps=1, storage=str(storage), **SETTINGS)
    with pytest.raises(UserError, match="no step 7|step 7|cannot load"):
        tinkerless.train(model=model, teacher="T@7", steps=1, storage=str(storage), **SETTINGS)


def test_a_killed_and_resumed_distillation_run_ends_identical_to_an_uninterrupted_one(setup, tmp_path):
    model, storage = setup
    steps = 4
    example = write_resumable_example(tmp_path / "opd.py", model, steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name in ("straight", "killed"):
        where = tmp_path / name
        (where / "runs").mkdir(parents=True)
        os.symlink(storage / "runs/T", where / "runs/T")  # the teacher run, beside the student's
        runs[name] = where
    cmd = lambda where, *extra: [*CLI, "train", str(example), "--storage", str(where), "--run-id", "r",  # noqa: E731
                                 "--no-progress", "--teacher", "T@2", "--distill-coef", "0.5", *extra]
    proc = subprocess.Popen(cmd(runs["killed"]), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while _latest(runs["killed"]) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 2 <= _latest(runs["killed"]) < steps
    done = subprocess.run(cmd(runs["killed"], "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    # The uninterrupted run, in this process with the subprocesses' one thread (the same float sums).
    from tinkerless.sdk.cli.commands import load_config

    config = load_config(str(example)).replace(storage=str(runs["straight"]), run_id="r", progress=False, threads=1,
                                                teacher="T@2", distill_coef=0.5)
    tinkerless.train(config)

    def final(where: Path) -> dict:
        return load_safetensors((where / f"runs/r/checkpoints/step-{steps}/adapter/adapter_model.safetensors").read_bytes())

    expected, actual = final(runs["straight"]), final(runs["killed"])
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after the resume"
    lines = lambda where: [json.loads(l) for l in (where / "runs/r/metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["step"] for r in lines(runs["killed"])] == list(range(steps))
    assert [r["teacher_logprob_gap"] for r in lines(runs["killed"])] == [r["teacher_logprob_gap"] for r in lines(runs["straight"])]


class _PromptScores(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible /v1/completions that scores prompts (echo=true, logprobs, max_tokens=0) with a real
    model, as vLLM answers; a prompt holding 'STALL' is never answered."""

    worker = None

    def do_POST(self):  # noqa: N802 - the http.server API
        from tinkerless.wire.messages import Datum, ForwardRequest

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "STALL" in body["prompt"]:
            time.sleep(2)
            return
        tokenizer = self.worker.tokenizer
        encoding = tokenizer(body["prompt"], add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"], dtype=np.int32)
        logprobs = self.worker.forward(ForwardRequest("base", [Datum(ids, np.zeros(len(ids), np.float32))])).logprobs[0]
        scored = {"tokens": tokenizer.convert_ids_to_tokens(encoding["input_ids"]),
                  "token_logprobs": [None, *map(float, logprobs[1:])],
                  "text_offset": [int(a) for a, _ in encoding["offset_mapping"]]}
        reply = json.dumps({"choices": [{"text": body["prompt"], "logprobs": scored}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_a_teacher_at_an_openai_endpoint_scores_every_sampled_token(setup):
    """The endpoint serves the student's own base model: the advantages of aligned tokens are zero. The tiny
    random student draws bytes that are no UTF-8, which the endpoint (reading text) cannot score as drawn:
    those are masked, the rest aligned."""
    from tinkerless.errors import InfrastructureFailure
    from tinkerless.functions.companions.endpoint import EndpointScorer
    from tinkerless.functions.worker import Worker

    model, storage = setup
    _PromptScores.worker = Worker(model)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PromptScores)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/v1"
    try:
        backend = Recording(model)
        result = tinkerless.train(model=model, teacher=url + "#model=tiny", steps=1, backend=backend,
                                  storage=str(storage), **SETTINGS)
        data = [d for update in backend.updates for d in update.data]
        assert data and 0.0 < result.metrics[0]["teacher_aligned_share"] <= 1.0
        for datum in data:
            np.testing.assert_allclose(datum.advantages[datum.mask > 0], 0.0, atol=2e-5)
        # A reply in valid UTF-8 (multi-byte characters included) aligns token for token, with the model's log-probs.
        worker = _PromptScores.worker
        prompt = worker.chat.prompt_tokens([{"role": "user", "content": "Say something."}])
        reply = list("Voilà: 12 × 7 = 84 😀".encode()) + [worker.chat.end_of_turn_id]
        tokens = np.asarray(prompt + reply, dtype=np.int32)
        mask = np.asarray([0.0] * len(prompt) + [1.0] * len(reply), dtype=np.float32)
        scorer = EndpointScorer(url, worker.tokenizer, timeout=0.3)
        rendering, logprobs = scorer.align(tokens, mask)
        assert sorted(p for unit, _ in rendering.units for p in unit) == list(range(len(prompt), len(tokens)))
        from tinkerless.wire.messages import Datum, ForwardRequest

        expected = worker.forward(ForwardRequest("base", [Datum(tokens, mask)])).logprobs[0]
        for unit, teacher in rendering.units:
            assert logprobs[teacher].sum() == pytest.approx(expected[unit].sum(), abs=1e-5)
        with pytest.raises(InfrastructureFailure) as failure:
            scorer.prompt_logprobs("STALL")
        assert failure.value.cause == "teacher_timeout"
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(InfrastructureFailure) as failure:
        EndpointScorer(url, None, timeout=1).prompt_logprobs("hello")  # nothing listens there now
    assert failure.value.cause == "teacher_failed"


def test_distillation_through_tinkerless_serve_matches_the_local_run(setup, tmp_path):
    """On a server the checkpoint teacher is a second adapter of the served model: the same numbers as locally."""
    from tinkerless.functions.worker import Worker
    from tinkerless.server import create_app, serve_in_thread

    model, storage = setup
    local = tinkerless.train(model=model, teacher="T@2", steps=1, run_id="local", storage=str(storage), **SETTINGS)
    with serve_in_thread(create_app(Worker(model), storage=str(tmp_path))) as url:
        tinkerless.train(model=model, reward=vowels, run_id="T", steps=2, backend=url, **SETTINGS)  # the teacher there
        served = tinkerless.train(model=model, teacher="T@2", steps=1, backend=url, run_id="served", **SETTINGS)
    for key in ("teacher_logprob_gap", "teacher_aligned_tokens", "loss", "reward_mean"):
        assert served.metrics[0][key] == pytest.approx(local.metrics[0][key], abs=1e-6), key
    assert served.usage["compute_seconds"]["teacher"] > 0


def test_topk_forward_kl_with_k_64_is_the_kl_of_the_teachers_top_k_by_hand(setup):
    """distill_loss='topk_forward_kl', k=64: the loss the update reports is sum_k q_T (log q_T - log p_S) over the
    teacher's renormalized top 64 at each sampled position, computed here from the two models' full logits."""
    model, storage = setup
    backend = Recording(model)
    result = tinkerless.train(model=model, teacher="T@2", distill_loss="topk_forward_kl", distill_topk=64, steps=1,
                              backend=backend, storage=str(storage), **SETTINGS)
    data = [d for update in backend.updates for d in update.data]
    assert data and all(d.target_topk_ids.shape == (len(d.tokens), 64) for d in data)
    assert backend.updates[0].loss.name == "topk_forward_kl"
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)  # step 0: the LoRA adds nothing yet
    total, count = 0.0, 0
    for datum in data:
        teacher = _full_logprobs(model, storage, datum.tokens)
        with torch.no_grad():
            mine = torch.log_softmax(student(input_ids=torch.as_tensor(datum.tokens, dtype=torch.long)[None]).logits[0].double(), -1)
        for t in np.nonzero(datum.mask > 0)[0]:
            top = torch.topk(teacher[t - 1], 64)
            np.testing.assert_array_equal(np.sort(datum.target_topk_ids[t]), np.sort(top.indices.numpy()))
            q = torch.softmax(top.values, -1)
            total += float((q * (torch.log(q) - mine[t - 1][top.indices])).sum())
            count += 1
    assert result.metrics[0]["loss"] == pytest.approx(total / count, rel=1e-4)
    assert result.metrics[0]["teacher_aligned_share"] == 1.0
    with pytest.raises(ConfigError):
        tinkerless.TrainConfig(model=model, tasks=[{"prompt": "x"}], teacher="T@2", distill_loss="topk_forward_kl",
                               distill_topk=1025).validate()
    with pytest.raises(ConfigError):
        tinkerless.TrainConfig(model=model, tasks=[{"prompt": "x"}], teacher="http://127.0.0.1:1/v1",
                               distill_loss="topk_forward_kl").validate()


def test_a_top_k_forward_reads_the_tokens_log_probs_from_its_own_pass(worker):
    """A teacher's forward with topk runs the decoder once: the tokens' log-probs it returns equal a plain
    forward's, for sequences of several lengths (one across the head's 256-row chunks) and any k, and each
    position's top k is sorted, starts at or above the token that follows, and holds it when it ranks within k."""
    from tinkerless.wire.messages import BASE_POLICY, Datum, ForwardRequest

    rng = np.random.default_rng(0)
    vocab = worker.model.config.vocab_size
    data = [Datum(rng.integers(0, vocab, n).astype(np.int32), (rng.random(n) < 0.5).astype(np.float32))
            for n in (2, 3, 17, 300)]
    plain = worker.forward(ForwardRequest(BASE_POLICY, data)).logprobs
    worker.forward(ForwardRequest(BASE_POLICY, data[:1], topk=1))  # the head/decoder split's one-time probe runs here
    passes = []  # the decoder's passes, counted at its embedding layer
    hook = worker.model.get_input_embeddings().register_forward_hook(lambda *_: passes.append(1))
    try:
        worker.forward(ForwardRequest(BASE_POLICY, data, topk=5))
    finally:
        hook.remove()
    assert len(passes) == len(data), "one pass per sequence, none for a separate log-prob forward"
    for k in (1, 5, 64):
        result = worker.forward(ForwardRequest(BASE_POLICY, data, topk=k))
        for datum, mine, reference, ids, lps in zip(data, result.logprobs, plain, result.topk_ids, result.topk_logprobs):
            assert mine.shape == reference.shape == (len(datum.tokens),) and mine[0] == 0.0
            np.testing.assert_allclose(mine, reference, atol=2e-5)
            assert ids.shape == lps.shape == (len(datum.tokens), k)
            assert np.all(np.diff(lps[1:], axis=1) <= 0) and np.all(lps[1:, 0] >= mine[1:] - 2e-5)
            within = mine[1:] > lps[1:, -1] + 1e-4  # clearly inside the top k: its id is among them
            assert all(datum.tokens[t + 1] in ids[t + 1] for t in np.nonzero(within)[0])


def test_the_top_k_update_batches_sequences_with_the_loss_and_gradient_of_one_at_a_time(tiny_model, monkeypatch):
    """topk_forward_kl's update runs sequences of similar length in one padded pass: its loss equals the KL summed
    by hand from each sequence's own unpadded forward, and its gradient the one-sequence-at-a-time update's, for
    sequences of several lengths (one with no trained position, one trained from position 0)."""
    from tinkerless.functions.training import topk_distillation
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import CreatePolicyRequest, Datum

    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("topk-batched"))
    policy = worker._policy("topk-batched")
    torch.manual_seed(0)
    for param in policy.params:  # away from LoRA's zero init, so that every adapter matrix has a gradient
        param.data.normal_(0, 0.05)
    rng = np.random.default_rng(1)
    vocab, k = worker.model.config.vocab_size, 8
    data = []
    for n, trained in ((3, [0, 1, 2]), (9, [4, 5, 6, 7, 8]), (10, []), (12, [2, 3, 11]), (40, list(range(20, 40)))):
        mask = np.zeros(n, np.float32)
        mask[trained] = 1.0
        ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n)]).astype(np.int32)
        lps = np.sort(torch.log_softmax(torch.as_tensor(rng.normal(0, 2, (n, k))), -1).numpy(), axis=1)[:, ::-1]
        data.append(Datum(rng.integers(0, vocab, n).astype(np.int32), mask, target_topk_ids=ids,
                          target_topk_logprobs=np.ascontiguousarray(lps, dtype=np.float32)))

    def update(micro_batch_size):
        for param in policy.params:
            param.grad = None
        with worker._activate("topk-batched"):
            metrics = topk_distillation.topk_backward(worker.model, data, micro_batch_size, worker.pad_id)
        return metrics, [param.grad.clone() for param in policy.params]

    batched, batched_grads = update(16)
    single, single_grads = update(1)
    monkeypatch.setattr(topk_distillation, "BATCHED_ROWS", 0)  # a batch too wide: one sequence at a time
    fallback, fallback_grads = update(16)
    by_hand, count = 0.0, 0
    with torch.no_grad(), worker._activate("topk-batched"):
        for datum in data:
            rows = [int(t) for t in np.nonzero(datum.mask)[0] if t >= 1]
            if not rows:
                continue
            logits = worker.model(input_ids=torch.as_tensor(datum.tokens, dtype=torch.long)[None]).logits[0]
            student = torch.log_softmax(logits.double(), -1)[torch.as_tensor(rows, dtype=torch.long) - 1]
            teacher = torch.as_tensor(datum.target_topk_logprobs[rows], dtype=torch.float64)
            by_hand += float(topk_distillation.topk_kl(student, torch.as_tensor(datum.target_topk_ids[rows],
                                                                                dtype=torch.long), teacher).sum())
            count += len(rows)
    assert batched["tokens"] == single["tokens"] == count == 2 + 5 + 3 + 20
    for metrics in (batched, single, fallback):
        assert metrics["loss"] == pytest.approx(by_hand / count, rel=1e-5)
    assert any(float(g.abs().sum()) > 0 for g in batched_grads)
    for grads in (single_grads, fallback_grads):
        for mine, reference in zip(batched_grads, grads):
            torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-6)


def _full_logprobs(model: str, storage: Path, tokens: np.ndarray) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = storage / "runs/T/checkpoints/step-2/adapter"
    net = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), str(adapter))
    with torch.no_grad():
        return torch.log_softmax(net(input_ids=torch.as_tensor(tokens, dtype=torch.long)[None]).logits[0].double(), -1)


def test_a_run_distills_from_its_own_earlier_checkpoint(setup, tmp_path):
    """Resumed with teacher='S@1', run S trains on toward its own step-1 adapter (self-distillation)."""
    model, _ = setup
    settings = {**SETTINGS, "storage": str(tmp_path), "run_id": "S", "reward": vowels}
    tinkerless.train(model=model, steps=2, **settings)
    result = tinkerless.train(model=model, steps=3, resume=True, teacher="S@1", **settings)
    assert [r["step"] for r in result.metrics] == [0, 1, 2]
    last = result.metrics[-1]
    assert last["teacher_aligned_share"] == 1.0 and abs(last["teacher_logprob_gap"]) > 1e-4  # it moved since step 1
    assert "teacher_logprob_gap" not in result.metrics[0]  # the steps before the teacher was named had none
