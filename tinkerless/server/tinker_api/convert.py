"""Tinker wire formats <-> tinkerless worker types.

Protobuf bodies are parsed and built with the message classes shipped inside the
official `tinker` SDK (`tinker.proto.tinker_public_pb2`), so the server speaks
exactly what the installed SDK speaks.

Alignment: a Tinker datum has `model_input` x[0..N-1] and per-position inputs
(target_tokens t, weights / advantages / logprobs) of length N, where position i
predicts t[i] from x[0..i]. A tinkerless `Datum` holds one token sequence whose
entry j is predicted from the entries before it. With the usual shift
(t[i] == x[i+1]) the sequence is x + [t[N-1]] and Tinker position i is entry i+1.
"""

from __future__ import annotations

import math

import numpy as np

from tinkerless.errors import UserError
from tinkerless.functions.losses import LossConfig
from tinkerless.wire.messages import Datum, SamplingParams

# Tinker losses are sums over tokens; thresholds are absolute ratio bounds.
_DEFAULT_THRESHOLDS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}
SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
# The Tinker docs name `beta` for dro but fix no default; this one is documented in docs/tinker.md.
DRO_DEFAULT_BETA = 0.05


def pb():
    from tinker.proto import tinker_public_pb2  # the SDK's own generated classes

    return tinker_public_pb2


def _tensor(msg, name: str) -> np.ndarray:
    p = pb()
    if msg.HasField("sparse_csr"):
        raise UserError(f"loss_fn_inputs[{name!r}] is a sparse tensor", hint="tinkerless accepts dense 1-D inputs")
    dtypes = {p.DTYPE_FLOAT32: np.float32, p.DTYPE_INT64: np.int64, p.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise UserError(f"loss_fn_inputs[{name!r}] has unsupported dtype {msg.dtype}", hint="send float32 or int64")
    array = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype])
    if len(msg.shape) > 1:
        raise UserError(
            f"loss_fn_inputs[{name!r}] has shape {list(msg.shape)}; only 1-D (one value per position) is supported",
            hint="multi-target (N, K) inputs are not supported by this server",
        )
    return array


def image_chunk(data: bytes, image_format: str, expected_tokens: int | None, vision, where: str):
    """A Tinker `ImageChunk` -> (its image tokens, the processed image): the image checked at the boundary
    (`wire.content`), processed by the model's own image processor, its placeholder repeated to its token count."""
    from tinkerless.wire.content import ImagePart, check_image

    if vision is None:
        raise UserError(f"{where}: an image chunk, and this server's model takes no images",
                        hint="serve a vision-language model (docs/vision.md), or send token chunks only")
    if image_format not in ("png", "jpeg"):
        raise UserError(f"{where}: image format {str(image_format)[:20]!r} is not png or jpeg")
    part = ImagePart(bytes(data), f"image/{image_format}")
    check_image(part, where)
    image = vision.process(part)
    if expected_tokens is not None and expected_tokens != image.num_tokens:
        raise UserError(f"{where}: the image is {image.num_tokens} tokens for this model, not the {expected_tokens} "
                        "expected_tokens says", hint="leave expected_tokens unset, or set it to the model's count")
    return [vision.image_token_id] * image.num_tokens, image


def with_images(raw: list, vision) -> list[tuple[np.ndarray, dict, list]]:
    """(tokens, inputs, processed images) of each parsed datum: its image chunks checked and processed."""
    out, count = [], 0
    for i, (segments, inputs) in enumerate(raw):
        tokens, images = [], []
        for segment in segments:
            if isinstance(segment, tuple):
                _count_image(count)
                count += 1
                ids, image = image_chunk(*segment, vision, f"datum {i}")
                tokens.append(np.asarray(ids, dtype=np.int32))
                images.append(image)
            else:
                tokens.append(segment)
        out.append((np.concatenate(tokens) if tokens else np.zeros(0, np.int32), inputs, images))
    return out


def _count_image(before: int) -> None:
    from tinkerless.wire.content import MAX_IMAGES_PER_REQUEST

    if before >= MAX_IMAGES_PER_REQUEST:
        raise UserError(f"the request holds more than {MAX_IMAGES_PER_REQUEST} image chunks",
                        hint="split it into smaller requests")


def parse_forward_backward(body: bytes):
    """The protobuf request body -> (model_id, seq_id, loss_fn, config dict, forward_only, datums); each datum is
    (segments, inputs): token arrays and image chunks (data, format, expected_tokens), resolved by `with_images`
    once the call holds its place in the model's order (a refused image must still use up its place)."""
    request = pb().ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise UserError(f"forward_backward body is not a valid protobuf ForwardBackwardRequest ({exc})") from exc
    config: dict[str, float | str] = dict(request.loss_fn_config)
    for key, value in request.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    datums = []
    for i, datum in enumerate(request.data):
        segments: list = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind == "image":
                image = chunk.image
                expected = image.expected_tokens if image.HasField("expected_tokens") else None
                segments.append((bytes(image.data), image.format, expected))
                continue
            if kind != "encoded_text":
                raise UserError(f"datum {i}: {kind} chunks are not supported", hint="send token and image chunks")
            segments.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        inputs = {name: _tensor(t, name) for name, t in datum.loss_fn_inputs.items()}
        datums.append((segments, inputs))
    return request.model_id, request.seq_id, request.loss_fn, config, request.forward_only, datums


_LOSS_CONFIG_KEYS = {
    "cross_entropy": set(),
    "importance_sampling": set(),
    "ppo": {"clip_low_threshold", "clip_high_threshold"},
    "cispo": {"clip_low_threshold", "clip_high_threshold"},
    "dro": {"beta"},
}


def loss_config(loss_fn: str, config: dict) -> LossConfig:
    if loss_fn not in SUPPORTED_LOSSES:
        raise UserError(
            f"unknown or unsupported loss_fn {loss_fn!r}",
            hint=f"this server supports {', '.join(SUPPORTED_LOSSES)}",
        )
    allowed = _LOSS_CONFIG_KEYS[loss_fn]
    unknown = set(config) - allowed
    if unknown:
        raise UserError(f"loss_fn_config keys {sorted(unknown)} are not supported for {loss_fn}",
                        hint=f"{loss_fn} takes {sorted(allowed) or 'no loss_fn_config'}")
    low, high = _DEFAULT_THRESHOLDS.get(loss_fn, (0.8, 1.2))
    low = _number(config, "clip_low_threshold", low)
    high = _number(config, "clip_high_threshold", high)
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= 1.0 <= high):
        raise UserError(f"clip thresholds must satisfy 0 <= low <= 1 <= high, got {low}, {high}")
    beta = _number(config, "beta", DRO_DEFAULT_BETA)
    if not (math.isfinite(beta) and beta >= 0.0):
        raise UserError(f"dro beta must be a finite number >= 0, got {beta}")
    # Sums over tokens, as Tinker defines its losses.
    return LossConfig(
        name=loss_fn, clip_low=1.0 - low, clip_high=high - 1.0, normalization="constant", normalization_constant=1.0,
        dro_beta=beta,
    )


def _number(config: dict, key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, str):
        raise UserError(f"loss_fn_config[{key!r}] must be a number, got the text {value[:40]!r}")
    return float(value)


def to_datum(index: int, tokens: np.ndarray, inputs: dict[str, np.ndarray], loss_fn: str) -> Datum:
    """One Tinker datum as a tinkerless `Datum` (see the module docstring for the alignment)."""
    n = len(tokens)
    if n == 0:
        raise UserError(f"datum {index} has an empty model_input")
    if "target_tokens" not in inputs:
        raise UserError(f"datum {index} has no target_tokens", hint="every datum needs loss_fn_inputs['target_tokens']")
    targets = inputs["target_tokens"].astype(np.int64)
    for name, values in inputs.items():
        if len(values) != n:
            raise UserError(
                f"datum {index}: loss_fn_inputs[{name!r}] has {len(values)} values for {n} model_input tokens",
                hint="per-position inputs are aligned with model_input (inputs = seq[:-1], targets = seq[1:])",
            )
    if n > 1 and not np.array_equal(targets[:-1], tokens[1:].astype(np.int64)):
        raise UserError(
            f"datum {index}: target_tokens are not model_input shifted by one",
            hint="send model_input = seq[:-1] and target_tokens = seq[1:]",
        )
    sequence = np.concatenate([tokens, targets[-1:].astype(np.int32)])

    def shifted(values: np.ndarray | None) -> np.ndarray | None:
        if values is None:
            return None
        return np.concatenate([np.zeros(1, np.float32), values.astype(np.float32)])

    # Every target position is scored (the caller gets logprobs for all of them); the
    # weights or advantages decide what trains, as in Tinker, so zeros contribute nothing.
    mask = np.concatenate([np.zeros(1, np.float32), np.ones(n, np.float32)])
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return Datum(sequence, mask, advantages=shifted(weights if weights is not None else np.ones(n, np.float32)))
    missing = [k for k in ("advantages", "logprobs") if k not in inputs]
    if missing:
        raise UserError(f"datum {index}: {loss_fn} needs loss_fn_inputs {missing}")
    return Datum(sequence, mask, advantages=shifted(inputs["advantages"]), sampler_logprobs=shifted(inputs["logprobs"]))


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A protobuf ForwardBackwardOutput: per-datum target logprobs plus `name:reduction` metrics."""
    p = pb()
    out = p.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    arrays = [np.asarray(lp, dtype=np.float32) for lp in logprobs]
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(arrays))
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    field.dtype = p.DTYPE_FLOAT32
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], str]], scores: dict | None = None) -> bytes:
    """A protobuf SampleResponse; `scores` are the prompt fields of `PromptScoring.compute`."""
    p = pb()
    out = p.SampleResponse(prompt_cache_hit_tokens=0)
    reasons = {"stop": p.STOP_REASON_STOP, "length": p.STOP_REASON_LENGTH}
    for tokens, logprobs, reason in sequences:
        out.sequences.add(
            stop_reason=reasons[reason],
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
    scores = scores or {}
    if scores.get("prompt_logprobs") is not None:
        out.prompt_logprobs = np.asarray(scores["prompt_logprobs"], dtype=np.float32).tobytes()
    if "topk_prompt_logprobs" in scores:
        ids, lps = scores["topk_prompt_logprobs"]
        out.topk_prompt_logprobs.CopyFrom(p.TopkLogprobs(
            token_ids=ids.astype(np.int32).tobytes(), logprobs=lps.astype(np.float32).tobytes(),
            k=ids.shape[1], length=ids.shape[0]))
    if "target_prompt_logprobs" in scores:
        values, csr = scores["target_prompt_logprobs"]
        if csr is None:  # same layout as the request: dense in, dense out
            out.target_prompt_logprobs.CopyFrom(_dense_tensor(values))
        else:
            crow, col = csr
            rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
            out.target_prompt_logprobs.CopyFrom(p.Tensor(
                sparse_csr=p.SparseCsr(values=values[rows, col].astype(np.float32).tobytes(),
                                       crow_indices=crow.astype(np.int64).tobytes(),
                                       col_indices=col.astype(np.int64).tobytes()),
                dtype=p.DTYPE_FLOAT32, shape=list(values.shape)))
    if "prompt_alt_tokens" in scores:
        tokens, lps = scores["prompt_alt_tokens"]
        out.prompt_alt_tokens.tokens.CopyFrom(_dense_tensor(tokens))
        out.prompt_alt_tokens.logprobs.CopyFrom(_dense_tensor(lps))
    return out.SerializeToString()


def _dense_tensor(array: np.ndarray):
    p = pb()
    dtype = {np.dtype(np.float32): p.DTYPE_FLOAT32, np.dtype(np.int64): p.DTYPE_INT64}[array.dtype]
    return p.Tensor(dense=np.ascontiguousarray(array).tobytes(), dtype=dtype, shape=list(array.shape))


def options(body: dict, key: str) -> dict:
    """An optional nested object of a request (`sampling_params`, `adam_params`, ...): absent or null is {}."""
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{key} must be a JSON object, got {type(value).__name__}", hint="see the Tinker API types")
    return value


def model_input_tokens(model_input: dict) -> list[int]:
    """Tokens of a JSON ModelInput ({"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]})."""
    return model_input_with_images(model_input, None)[0]


def model_input_with_images(model_input: dict, vision) -> tuple[list[int], list]:
    """Tokens and processed images of a JSON ModelInput; image chunks ({"type": "image", "data": base64,
    "format": "png" | "jpeg", "expected_tokens"}) only for a vision-language model (`vision`)."""
    import base64
    import binascii

    tokens: list[int] = []
    images: list = []
    chunks = (model_input or {}).get("chunks", [])
    if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
        raise UserError("prompt.chunks must be a list of chunk objects", hint='send {"chunks": [{"tokens": [...]}]}')
    for chunk in chunks:
        if chunk.get("type") == "image":
            _count_image(len(images))
            data, expected = chunk.get("data"), chunk.get("expected_tokens")
            if not isinstance(data, str) or (expected is not None and (not isinstance(expected, int) or isinstance(expected, bool))):
                raise UserError("an image chunk needs base64 'data' (and an integer 'expected_tokens', or none)")
            try:
                raw = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise UserError("an image chunk's data is not valid base64") from None
            ids, image = image_chunk(raw, chunk.get("format"), expected, vision, "prompt")
            tokens.extend(ids)
            images.append(image)
            continue
        if not isinstance(chunk.get("tokens", []), list):
            raise UserError("a prompt chunk's tokens must be a list of token ids")
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"{chunk.get('type')} prompt chunks are not supported", hint="send token chunks only")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    return tokens, images


ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
UNEMBED_MODULE = "lm_head"


def lora_target_modules(lora: dict) -> list[str]:
    """LoRA targets for Tinker's train_attn / train_mlp / train_unembed flags (all default to true).

    The unembedding is trained as LoRA on `lm_head`; with tied embeddings (SmolLM2) the shared
    base matrix stays frozen and only the adapter's low-rank delta on the output layer trains.
    """
    attn, mlp, unembed = (bool(lora.get(k, True)) for k in ("train_attn", "train_mlp", "train_unembed"))
    if not (attn or mlp or unembed):
        raise UserError("lora_config trains nothing", hint="set at least one of train_attn, train_mlp, train_unembed")
    return (ATTENTION_MODULES if attn else []) + (MLP_MODULES if mlp else []) + ([UNEMBED_MODULE] if unembed else [])


def tinker_metrics(metrics: dict[str, float], num_datums: int) -> dict[str, float]:
    """tinkerless metric names -> Tinker's `name:reduction` keys (the SDK rejects any other shape)."""
    out = {"loss:sum": float(metrics.get("loss", 0.0))}
    for key, value in metrics.items():
        if key == "loss":
            continue
        out[f"{key.replace(':', '_')}:{'sum' if key == 'tokens' else 'mean'}"] = float(value)
    out["num_datums:sum"] = float(num_datums)
    return out


def sampling_params(params: dict, worker) -> tuple[SamplingParams, list[str]]:
    max_tokens = params.get("max_tokens")
    max_tokens = int(max_tokens) if max_tokens is not None else 256
    if not 0 <= max_tokens <= 32768:
        raise UserError(f"max_tokens={max_tokens} is out of range")
    stop = params.get("stop")
    stop_ids: list[int] | None = None
    stop_strings: list[str] = []
    if stop is not None:
        items = [stop] if isinstance(stop, str) else list(stop)
        stop_ids = [int(s) for s in items if isinstance(s, int)]
        stop_strings = [s for s in items if isinstance(s, str)]
        if stop_strings:
            stop_ids = list(worker.chat.eos_token_ids) + stop_ids  # strings keep the implicit end of turn
    top_k = int(params.get("top_k", -1))
    return (
        SamplingParams(
            max_tokens=max_tokens,
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=top_k if top_k > 0 else 0,
            stop_token_ids=stop_ids,
        ),
        stop_strings,
    )


def apply_stop_strings(generation, stop_strings: list[str], tokenizer) -> tuple[list[int], list[float], str]:
    """Cut a generation after the first token that completes a stop string."""
    tokens, logprobs, reason = list(generation.tokens), list(generation.logprobs), generation.stop_reason

    def stops(end: int) -> bool:
        text = tokenizer.decode(tokens[:end])
        return any(s in text for s in stop_strings)

    if not stop_strings or not stops(len(tokens)):
        return tokens, logprobs, reason
    # A prefix that contains a stop string keeps containing it as it grows: the shortest one is found
    # by bisection, in O(log n) decodes rather than one per token (which was O(n^2) on a long sample).
    low, high = 1, len(tokens)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if stops(middle) else (middle + 1, high)
    return tokens[:low], logprobs[:low], "stop"
