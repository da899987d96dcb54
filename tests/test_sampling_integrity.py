"""Every sampled token returned is one the sampler drew, with its true log-prob and the right stop reason.

The class of bug: a sample that ends at the model's EOS though `stop=[]` asked for none, a
batched row padded after it stopped (pad tokens returned with log-probs), a stop reason that
does not match the tokens. Checked for the model's own EOS (stop=None), `stop=[]`, stop token
ids and stop strings, one row and batches whose rows stop at different times, greedy and
sampled; through the engine and through the official Tinker SDK's `sample` on a live server.

The tiny random model almost never draws its real end-of-turn token, so these workers declare
a set of common tokens (every 7th id) as the model's end-of-turn tokens: rows then stop after
a few tokens, at different times, which is what the checks need.
"""

from __future__ import annotations

import os

import pytest
import torch

from tinkerless.functions.sampling.engine import row_seed
from tinkerless.functions.sampling.slicing import slice_host
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig, SamplingParams

END_OF_TURN = list(range(0, 259, 7))  # ~14% of the tiny model's 259 tokens
PROMPTS = [[3, 4, 5], [10, 11, 12, 13, 14, 15, 16], [3, 4, 5], [40], [7, 8, 9, 10, 11], [3, 4, 5]]


def declare_end_of_turn(worker: Worker, tokens: list[int]) -> Worker:
    """Make `tokens` the model's end-of-turn tokens everywhere the model's EOS is read."""
    worker.engine.eos_token_ids = list(tokens)
    worker.chat.eos_token_ids = list(tokens)
    worker.base_model.generation_config.eos_token_id = list(tokens)
    return worker


@pytest.fixture(scope="module")
def eos_worker(tiny_model):
    return declare_end_of_turn(Worker(tiny_model), END_OF_TURN)


def forward_logits(worker: Worker, prompt: list[int], tokens: list[int], policy: str | None = None) -> torch.Tensor:
    """The model's logits for each returned token's position: one forward pass over prompt + tokens."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad(), worker._activate(policy):
        logits = worker.model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def check_generation(worker, prompt, tokens, logprobs, reason, *, stop_set, sampling, policy=None) -> None:
    """The invariants of one returned sequence; `stop_set` is the set of tokens that may end it."""
    assert len(tokens) == len(logprobs) >= 1
    assert reason in ("stop", "length")
    if reason == "stop":
        assert tokens[-1] in stop_set and len(tokens) <= sampling.max_tokens
        assert not any(t in stop_set for t in tokens[:-1]), "the sample ran past a stop token"
    else:
        assert len(tokens) == sampling.max_tokens, "ended early without a stop token"
        assert not any(t in stop_set for t in tokens), "a stop token did not end the sample"
    logits = forward_logits(worker, prompt, tokens, policy)
    true_logprobs = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert torch.allclose(torch.tensor(logprobs), true_logprobs, atol=1e-4), "log-probs differ from a forward pass"
    if sampling.temperature == 0:
        assert tokens == logits.argmax(-1).tolist(), "a greedy sample returned a token that is not the argmax"
    elif sampling.top_k:
        top = logits.topk(sampling.top_k, -1).indices
        assert all(t in top[i].tolist() for i, t in enumerate(tokens)), "a token outside top_k was returned"


STOP_CASES = {"model end-of-turn (stop=None)": None, "stop=[]": [], "stop token ids": list(range(3, 259, 9))}
TEMPERATURES = {"greedy": dict(temperature=0.0), "sampled top_k": dict(temperature=1.0, top_k=40)}


@pytest.mark.parametrize("stop", list(STOP_CASES.values()), ids=list(STOP_CASES))
@pytest.mark.parametrize("mode", list(TEMPERATURES.values()), ids=list(TEMPERATURES))
def test_every_returned_token_was_drawn_with_its_true_logprob_and_reason(eos_worker, stop, mode):
    sampling = SamplingParams(max_tokens=24, stop_token_ids=stop, **mode)
    stop_set = set(END_OF_TURN if stop is None else stop)
    generations = eos_worker.engine.generate(PROMPTS, sampling, policy=None, seed=5)
    assert len(generations) == len(PROMPTS)
    for prompt, g in zip(PROMPTS, generations):
        check_generation(eos_worker, prompt, g.tokens, g.logprobs, g.stop_reason, stop_set=stop_set, sampling=sampling)
    if stop == []:  # nothing ends early, not even the model's end-of-turn tokens, which the rows did draw
        assert all(g.stop_reason == "length" for g in generations)
        if mode["temperature"] > 0:
            assert any(t in END_OF_TURN for g in generations for t in g.tokens)
    elif mode["temperature"] > 0:  # rows of one batch stopped at different times
        assert len({len(g.tokens) for g in generations}) > 1 and any(g.stop_reason == "stop" for g in generations)


def test_a_row_samples_the_same_tokens_alone_or_in_a_batch(eos_worker):
    """Row i of a request draws from its own generator seeded by (seed, i), not from the batch's shared stream."""
    sampling = SamplingParams(max_tokens=16, temperature=1.0, stop_token_ids=None)
    batch = eos_worker.engine.generate(PROMPTS, sampling, policy=None, seed=9)
    for i, prompt in enumerate(PROMPTS):
        job = eos_worker.engine.start([prompt], sampling, seed=9, first_index=i)
        with torch.no_grad():
            while not job.done:
                job.advance(eos_worker.model)
        assert job.results()[0].tokens == batch[i].tokens
    assert row_seed(9, 0) != row_seed(9, 1) != row_seed(10, 0)


class DisruptiveHost:
    """A slice host that pauses the job after every step and, while it is paused, uses the model
    for something else: another policy's generation with its own seed (switching the adapter)."""

    def __init__(self, worker: Worker):
        self.worker, self.pauses, self.busy = worker, 0, False

    def due(self) -> bool:
        return not self.busy  # the work run during a pause is not itself paused

    def pause(self) -> None:
        self.pauses += 1
        if self.pauses % 3 == 0:
            self.busy = True
            try:
                self.worker.engine.generate([[1, 2]], SamplingParams(max_tokens=3), policy="other", seed=self.pauses)
            finally:
                self.busy = False


def test_a_seeded_request_gives_the_same_tokens_sliced_or_not(tiny_model):
    worker = declare_end_of_turn(Worker(tiny_model), END_OF_TURN)
    worker.create_policy(CreatePolicyRequest("mine", LoraConfig(rank=4, seed=1)))
    worker.create_policy(CreatePolicyRequest("other", LoraConfig(rank=4, seed=2)))
    # A visibly different policy from the base model, from its own generator (the global RNG's state depends on the
    # tests run before), whose rows run for up to 20 steps here: enough pauses to slice.
    generator = torch.Generator().manual_seed(4)
    for p in worker.policies["mine"].params:
        torch.nn.init.normal_(p.data, std=0.2, generator=generator)
    sampling = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, stop_token_ids=None)
    whole = worker.engine.generate(PROMPTS, sampling, policy="mine", seed=3)
    host = DisruptiveHost(worker)
    with slice_host(host):
        sliced = worker.engine.generate(PROMPTS, sampling, policy="mine", seed=3)
    # It paused after every step it drove; the other policy's generation run during a pause joins the
    # shared batch (tinkerless.functions.sampling.batcher) and decodes these rows too, in one mixed-adapter forward.
    assert host.pauses >= 5
    assert [(g.tokens, g.stop_reason) for g in sliced] == [(g.tokens, g.stop_reason) for g in whole]
    for a, b in zip(sliced, whole):  # batched with other rows: equal up to floating-point differences
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    for prompt, g in zip(PROMPTS, sliced):  # and the adapter was back in place for every slice
        check_generation(worker, prompt, g.tokens, g.logprobs, g.stop_reason, stop_set=set(END_OF_TURN),
                         sampling=sampling, policy="mine")


def test_batches_split_by_rows_and_kv_positions_give_the_same_rows(eos_worker):
    engine = eos_worker.engine
    sampling = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=[])
    whole = engine.generate(PROMPTS, sampling, policy=None, seed=4)
    saved = engine.max_batch_size, engine.max_batch_positions
    try:
        engine.max_batch_size, engine.max_batch_positions = 4, 40  # at most 2 rows of up to 7 + 12 positions
        assert all(end - start <= 2 for start, end in engine.batches(PROMPTS, 12))
        split = engine.generate(PROMPTS, sampling, policy=None, seed=4)
    finally:
        engine.max_batch_size, engine.max_batch_positions = saved
    assert [g.tokens for g in split] == [g.tokens for g in whole]


# -- through the official Tinker SDK --------------------------------------------------------------

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture(scope="module")
def tinker_server(tmp_path_factory, tiny_model):
    from tinkerless.server import create_app, serve_in_thread
    from tinkerless.server.keys import KeyStore
    from tinkerless.storage import ObjectStore

    root = tmp_path_factory.mktemp("integrity-server")
    keys = KeyStore(ObjectStore(str(root)))
    key = keys.create("alice")
    worker = declare_end_of_turn(Worker(tiny_model), END_OF_TURN)
    app = create_app(worker, keys=keys, storage=str(root))
    with serve_in_thread(app) as url:
        client = tinker.ServiceClient(base_url=url, api_key=key)
        yield client.create_sampling_client(base_model=tiny_model).result(), worker
        client.close(status="success")


SDK_STOPS = {"stop=None": None, "stop=[]": [], "stop token ids": list(range(3, 259, 9)), "stop strings": ["A", "zz"]}


@pytest.mark.parametrize("stop", list(SDK_STOPS.values()), ids=list(SDK_STOPS))
def test_tinker_sample_returns_only_drawn_tokens_with_true_logprobs(tinker_server, stop):
    sampler, worker = tinker_server
    prompt = [3, 4, 5, 6]
    params = types.SamplingParams(max_tokens=20, temperature=1.0, seed=21, stop=stop)
    result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=6, sampling_params=params).result()
    assert len(result.sequences) == 6
    stop_ids = set(END_OF_TURN) if stop is None or (stop and isinstance(stop[0], str)) else set(stop)
    sampling = SamplingParams(max_tokens=20, temperature=1.0)
    for seq in result.sequences:
        tokens, logprobs = list(seq.tokens), list(seq.logprobs)
        if stop and isinstance(stop[0], str):
            texts = [worker.tokenizer.decode(tokens[:end]) for end in range(len(tokens) + 1)]
            hit = next((end for end, text in enumerate(texts) if any(s in text for s in stop)), None)
            if hit is not None:  # the stop string ends it, exactly at the token that completed it
                assert seq.stop_reason == "stop" and len(tokens) == hit
                tokens, logprobs = tokens[:-1], logprobs[:-1]  # the rest must still follow the token rules
                if not tokens:
                    continue
                check_generation(worker, prompt, tokens, logprobs, "length", stop_set=stop_ids,
                                 sampling=SamplingParams(max_tokens=len(tokens), temperature=1.0))
                continue
        check_generation(worker, prompt, tokens, logprobs, seq.stop_reason, stop_set=stop_ids, sampling=sampling)
    # The server's own forward pass (the SDK's compute_logprobs) scores the sampled tokens the same way.
    seq = result.sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + list(seq.tokens))).result()
    assert torch.allclose(torch.tensor(scored[len(prompt):]), torch.tensor(list(seq.logprobs)), atol=1e-4)
    if stop == []:
        assert all(s.stop_reason == "length" and len(s.tokens) == 20 for s in result.sequences)
        assert any(t in END_OF_TURN for s in result.sequences for t in s.tokens)


def test_the_sampler_draws_from_the_filtered_distribution(eos_worker):
    """Inverse-CDF picks follow the probabilities, and a token of zero probability is never drawn."""
    rows = 4000
    job = eos_worker.engine.start([[1]] * rows, SamplingParams(max_tokens=1, temperature=1.0), seed=0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    picks, _ = job.draw(probs.log().expand(rows, -1).clone())  # softmax of the log-probs at temperature 1: probs
    counts = torch.bincount(picks, minlength=len(probs)).float()
    assert counts[probs == 0].sum() == 0
    expected = probs * rows
    sigma = (rows * probs * (1 - probs)).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1e-9).all(), counts


def test_an_empty_prompt_is_a_user_error(eos_worker):
    from tinkerless.errors import UserError

    with pytest.raises(UserError, match="empty"):
        eos_worker.engine.generate([[3, 4], []], SamplingParams(max_tokens=2), policy=None, seed=0)


def test_non_finite_logits_are_refused_greedy_or_sampled():
    """A diverged adapter's NaN or infinite logits are never recorded as the policy's samples."""
    import torch

    from tinkerless.errors import UserError
    from tinkerless.functions.sampling.device_sampling import DrawSettings, row_keys
    from tinkerless.functions.sampling.engine import draw_rows
    from tinkerless.wire.messages import SamplingParams

    def settings(temperature):
        return DrawSettings.of(row_keys([0, 1]), [SamplingParams(temperature=temperature)] * 2, "cpu")

    positions = torch.zeros(2, dtype=torch.long)
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(2, 5)
        logits[1, 3] = bad
        for temperature in (0.0, 1.0):
            with pytest.raises(UserError, match="not finite"):
                draw_rows(logits, settings(temperature), positions)
    picks, logprobs = draw_rows(torch.zeros(2, 5), settings(1.0), positions)
    assert torch.isfinite(logprobs).all() and ((0 <= picks) & (picks < 5)).all()
