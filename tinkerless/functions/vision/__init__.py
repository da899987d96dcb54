"""Vision-language models on the worker: loading them, images to model inputs, sampling and training with images.

Its own room beside `rollout/`, `sampling/` and `training/` so the text engine stays as it is: `models` (knowing,
loading and building VLMs, LoRA targets), `processing` (image processor, image-token expansion, chat turns with
images in token space), `inputs` (image features merged into embeddings, multimodal positions: shared by the
sampler and the update), `sampler` (prefill with images, decode, conversations' kept caches), `episodes` (the
rollout loop with images), `training` (forward/forward_backward on datums with images), `runtime` (what a worker
holds for a VLM), `checks` (a request's images against the worker's model). The content parts themselves are
wire types (`tinkerless.wire.content`).
"""
