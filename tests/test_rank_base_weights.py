"""The base weights on the ranks of a sharded update (`sharding/base_weights.py`): no rank loads the whole model.

- the model built with placeholder weights holds one element a parameter, and once filled from the checkpoint it
  is the model `from_pretrained` loads, value for value (tied or untied, one file or an index of several, fp32
  weights read into bf16; a local directory or a Hub id's snapshot in the HF cache);
- on two ranks each rank's shard is its own rows of the checkpoint's tensors (uneven splits too), read after the
  policy's LoRA weights were seeded as on one process, and the base model's log-probs before any policy equal
  one process's;
- a checkpoint that cannot be read in shards (.bin weights, a name the model does not have, modules transformers
  keeps in fp32 in a bf16 run, an index that is not a map of keys to files of its directory) loads whole, and the
  ranks give the same log-probs; a model.safetensors beside an index is read, as from_pretrained reads it;
- across eleven architectures, each is either read exactly as `from_pretrained` reads it (every dense one) or
  loads whole (fused MoE experts, a renamed head), in fp32 and bf16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinkerless.functions.models import _tiny_tokenizer, build_tiny_model, load_model
from tinkerless.functions.sharding import base_weights
from tinkerless.functions.sharding.group import ShardedWorker
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import BASE_POLICY, CreatePolicyRequest, Datum, ForwardRequest, LoraConfig


def is_placeholder(param: torch.Tensor) -> bool:
    """A parameter not yet filled: one element of memory for a tensor of more."""
    return param.numel() > 1 and param.untyped_storage().nbytes() <= param.element_size()


def save_qwen2(path: Path, *, tied: bool, max_shard_size: str | None = None, safetensors: bool = True) -> str:
    """A tiny random Qwen2 (vocabulary 259: an odd number of rows to split) saved as given."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, initializer_range=0.2,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(path)
    if not safetensors:  # the older pickle format (transformers 5 writes safetensors only)
        (path / "model.safetensors").unlink()
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    return str(path)


@pytest.fixture(scope="module")
def untied_in_files(tmp_path_factory) -> str:
    path = save_qwen2(tmp_path_factory.mktemp("models") / "untied", tied=False, max_shard_size="20KB")
    assert (Path(path) / "model.safetensors.index.json").is_file()
    return path


def assert_same_model(got, expected) -> None:
    ours, theirs = got.state_dict(), expected.state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    tokens = torch.arange(3, 40).reshape(1, -1)
    assert torch.equal(got(tokens).logits, expected(tokens).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["tied, one file", "untied, an index of files"])
def test_placeholders_take_no_memory_and_fill_to_the_loaded_model(tiny_model, untied_in_files, which, dtype):
    path = tiny_model if which.startswith("tied") else untied_in_files
    found = base_weights.placeholder_model(path, dtype)
    assert found is not None
    model, tokenizer, checkpoint = found
    for name, param in model.named_parameters():
        assert param.dtype == dtype and (param.numel() == 1 or is_placeholder(param)), name
    expected, expected_tokenizer = load_model(path, dtype=dtype)
    assert model.generation_config == expected.generation_config and tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id == expected_tokenizer.pad_token_id
    for (name, buffer), (_, loaded) in zip(model.named_buffers(), expected.named_buffers(), strict=True):
        assert torch.equal(buffer, loaded), name  # rotary frequencies are computed, not read

    read = base_weights.fill(model, checkpoint)
    assert read == sum(p.numel() for p in expected.parameters())  # a tied weight is read once
    assert not any(is_placeholder(p) for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == which.startswith("tied")
    assert_same_model(model, expected)


ARCHITECTURES = {  # name: (config class, model class, options beyond the common tiny ones, read in shards?)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, True),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}, True),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}, True),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, True),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, True),
    # transformers fuses MoE experts while loading: the names differ from the file's, so these load whole
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}, None),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 16}, None),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_every_architecture_is_read_as_from_pretrained_reads_it_or_loads_whole(tmp_path, architecture, dtype):
    """Names and shapes that match the file are read as they are: nothing transformers would change while loading
    may pass that check. Dense models are read in shards; where transformers maps names (fused MoE experts), whole."""
    import transformers

    config_class, model_class, options, in_shards = ARCHITECTURES[architecture]
    tokenizer = _tiny_tokenizer()
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **options)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    found = base_weights.placeholder_model(str(tmp_path), dtype)
    if in_shards is not None:
        assert (found is not None) == in_shards
    if found is not None:
        model, _, checkpoint = found
        base_weights.fill(model, checkpoint)
        assert_same_model(model, load_model(str(tmp_path), dtype=dtype)[0])


def test_a_model_transformers_keeps_partly_in_fp32_loads_whole_in_bf16(tiny_model, monkeypatch):
    """from_pretrained upcasts `_keep_in_fp32_modules` (MoE routers, some norms); a bf16 skeleton would not."""
    from transformers import Qwen2ForCausalLM

    monkeypatch.setattr(Qwen2ForCausalLM, "_keep_in_fp32_modules", ["norm"])
    assert base_weights.placeholder_model(tiny_model, torch.bfloat16) is None
    assert base_weights.placeholder_model(tiny_model, torch.float32) is not None


@pytest.mark.parametrize("which", ["tied, one file", "untied, an index of files"])
def test_a_hub_id_reads_its_snapshot_in_the_hf_cache(tmp_path, tiny_model, untied_in_files, which, monkeypatch):
    """A model named by its Hub id (as on Modal, whose Volume holds the HF cache) is read in shards as well; one the
    cache does not hold, offline, loads whole (from_pretrained then says what is missing)."""
    import huggingface_hub.constants

    from tinkerless.functions.hf_cache import place_in_hf_cache

    path = tiny_model if which.startswith("tied") else untied_in_files
    snapshot = place_in_hf_cache(path, "tinkerless-test/tiny", cache_dir=tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model, _, checkpoint = base_weights.placeholder_model("tinkerless-test/tiny", torch.float32)
    assert Path(checkpoint.directory) == snapshot
    base_weights.fill(model, checkpoint)
    assert_same_model(model, load_model(path)[0])
    assert base_weights.placeholder_model("tinkerless-test/not-in-the-cache", torch.float32) is None


def test_a_checkpoint_that_cannot_be_read_in_shards_loads_whole(tmp_path, tiny_model, monkeypatch):
    as_bin = save_qwen2(tmp_path / "bin", tied=True, safetensors=False)
    assert base_weights.placeholder_model(as_bin, torch.float32) is None

    from safetensors.torch import load_file, save_file

    renamed = Path(build_tiny_model(tmp_path / "renamed"))
    weights = load_file(renamed / "model.safetensors")
    weights["model.norm.scale"] = weights.pop("model.norm.weight")  # a name transformers would have to map
    save_file(weights, renamed / "model.safetensors", metadata={"format": "pt"})
    assert base_weights.placeholder_model(str(renamed), torch.float32) is None

    # An index that is not a map of keys to file names of this directory (and no model.safetensors beside it).
    indexed = Path(save_qwen2(tmp_path / "indexed", tied=True, max_shard_size="20KB"))
    for index in ("not json", "{}", '{"weight_map": ["a"]}', '{"weight_map": {"a": 5}}',
                  '{"weight_map": {"a": "/etc/passwd"}}', '{"weight_map": {"a": "../renamed/model.safetensors"}}'):
        (indexed / "model.safetensors.index.json").write_text(index)
        assert base_weights.placeholder_model(str(indexed), torch.float32) is None, index

    monkeypatch.setenv("TINKERLESS_WHOLE_BASE_ON_RANKS", "1")
    assert base_weights.placeholder_model(tiny_model, torch.float32) is None


def test_a_single_file_wins_over_an_index_beside_it_as_in_from_pretrained(tmp_path, untied_in_files):
    """from_pretrained reads model.safetensors where it exists and ignores an index beside it (a stale one here,
    naming the files of another save): so does each rank."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = Path(save_qwen2(tmp_path / "single", tied=False))  # the same values as untied_in_files ...
    weights = {key: value + 1 for key, value in load_file(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})  # ... until moved here
    for name in Path(untied_in_files).iterdir():  # the other save's index and files, with the old values
        if name.name.startswith("model-") or name.name == "model.safetensors.index.json":
            shutil.copy(name, path / name.name)
    model, _, checkpoint = base_weights.placeholder_model(str(path), torch.float32)
    assert sorted(set(checkpoint.file_of.values())) == ["model.safetensors"]
    base_weights.fill(model, checkpoint)
    assert_same_model(model, load_model(str(path))[0])


def test_a_saved_non_persistent_buffer_is_ignored_as_from_pretrained_ignores_it(tmp_path):
    """Old checkpoints hold rotary frequencies; the model computes its own (a stale file value must not win)."""
    from safetensors.torch import load_file, save_file

    path = Path(build_tiny_model(tmp_path / "with-inv-freq"))
    weights = load_file(path / "model.safetensors")
    weights["model.rotary_emb.inv_freq"] = torch.full((8,), 7.0)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    model, _, checkpoint = base_weights.placeholder_model(str(path), torch.float32)
    base_weights.fill(model, checkpoint)
    assert_same_model(model, load_model(str(path))[0])
    assert not torch.equal(model.model.rotary_emb.inv_freq, torch.full((8,), 7.0))


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 300), world_size=st.integers(1, 8))
def test_each_rank_reads_the_rows_fsdp2_keeps_on_it(rows, world_size):
    """torch.chunk's split of dim 0, which FSDP2 shards by: ceil(rows / N) a rank, the last ranks fewer or none."""
    chunks = torch.arange(rows).chunk(world_size) if rows else ()
    for rank in range(world_size):
        start, stop = base_weights.rows_of_rank(rows, rank, world_size)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == expected


def check_shards_against_checkpoint(worker) -> None:
    """A rank hook: before any policy the weights are placeholders; after create_policy each base weight's local
    shard is this rank's rows of the checkpoint's tensor, and the LoRA weights are the single process's."""
    from safetensors.torch import load_file

    assert worker.checkpoint is not None, "the rank loaded the whole model"
    assert all(is_placeholder(p) for p in worker.model.parameters() if p.numel() > 1)
    create = worker.create_policy

    def create_and_check(request):
        reply = create(request)
        whole = {}
        for name in sorted(set(worker.checkpoint.file_of.values())):
            whole.update(load_file(Path(worker.checkpoint.directory) / name))
        for module in worker.model.modules():
            for name, key in getattr(module, "_tinkerless_checkpoint_keys", {}).items():
                param = module._parameters[name]
                start, stop = base_weights.rows_of_rank(param.shape[0], worker.rank, worker.world_size)
                local = param.to_local()
                assert local.data_ptr() != 0 and torch.equal(local, whole[key][start:stop].to(local.dtype)), key
        return reply

    worker.create_policy = create_and_check


def base_logprobs(worker) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    data = []
    for n in (5, 9, 13):
        mask = np.zeros(n, np.float32)
        mask[1:] = 1
        data.append(Datum(rng.integers(0, 255, n).astype(np.int32), mask))
    return worker.forward(ForwardRequest(BASE_POLICY, data)).logprobs


@pytest.mark.parametrize("which", ["untied, an index of files", "tied, .bin weights: loaded whole"])
def test_two_ranks_hold_their_own_rows_and_score_as_one_process(tmp_path, untied_in_files, which):
    path = untied_in_files if which.startswith("untied") else save_qwen2(tmp_path / "bin", tied=True, safetensors=False)
    hook = check_shards_against_checkpoint if which.startswith("untied") else None
    one = Worker(path, micro_batch_size=2)
    group = ShardedWorker(path, world_size=2, device="cpu", micro_batch_size=2, rank_hook=hook, grace_s=5.0)
    try:
        # Before any policy: the ranks shard the base model to answer (placeholders are read on sharding).
        for ours, theirs in zip(base_logprobs(group), base_logprobs(one), strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5)
        lora = LoraConfig(rank=4, alpha=8, seed=3)
        one.create_policy(CreatePolicyRequest("p", lora))
        group.create_policy(CreatePolicyRequest("p", lora))  # the ranks rebuild with the policy, and check their rows
        for ours, theirs in zip(base_logprobs(group), base_logprobs(one), strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5)
    finally:
        group.close()
