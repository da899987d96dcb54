"""The precision policy: which dtype the base weights hold, and what always stays fp32.

One setup for every function that touches the model (the sampler, the forward, the update), so the
sampler and the trainer compute with the same weights:

- `auto` (the default): bf16 on a CUDA device that supports it, fp32 elsewhere (a CPU keeps today's
  numbers bit for bit); `bf16` and `fp32` name one outright (bf16 on a CPU works, and is slower there);
- the base weights are held in that dtype (an 8B model in bf16 is 16 GB instead of 32);
- the LoRA parameters and their optimizer state stay fp32 whatever the base dtype (peft keeps adapter
  weights fp32 on a bf16 base), so small updates are not rounded away and a saved adapter is fp32 on
  disk: an adapter trained in bf16 loads on an fp32 worker and the other way round;
- logits are upcast before any log-softmax, and losses and advantages are computed in fp32.
"""

from __future__ import annotations

from typing import Any

from tinkerless.errors import ConfigError

DTYPES = ("auto", "bf16", "fp32")  # (torch loads only where a dtype is resolved: configs check names alone)


def check_dtype(name: object) -> str:
    """`name` when it is one of DTYPES; a ConfigError naming them otherwise."""
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r} is not a precision tinkerless knows",
                          hint="use 'auto' (bf16 on a GPU that supports it, fp32 on a CPU), 'bf16' or 'fp32'")
    return str(name)


def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_dtype(name: str, device: str) -> Any:
    """The torch dtype of the base weights for precision `name` on `device`."""
    import torch

    name = check_dtype(name)
    if name == "auto":
        on_cuda = device.startswith("cuda") and torch.cuda.is_available()
        name = "bf16" if on_cuda and torch.cuda.is_bf16_supported() else "fp32"
    return _torch_dtypes()[name]


def dtype_name(dtype: Any) -> str:
    """"bf16" or "fp32" (what `info` and a run's summary report)."""
    return next((name for name, value in _torch_dtypes().items() if value == dtype), str(dtype).removeprefix("torch."))
