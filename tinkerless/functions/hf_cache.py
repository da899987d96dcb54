"""Place a local model directory in the standard Hugging Face cache under a Hub id.

A Tinker client names models by their Hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`) and
loads tokenizers with `AutoTokenizer.from_pretrained(<id>)`. On a machine without Hub
access that only works offline (`HF_HUB_OFFLINE=1`) when the cache already holds the
repo, in the layout `huggingface_hub` itself writes:

    <cache>/models--<owner>--<name>/blobs/<sha256>            file contents
    <cache>/models--<owner>--<name>/snapshots/<rev>/<file>    symlinks to the blobs
    <cache>/models--<owner>--<name>/refs/main                 "<rev>"

`<rev>` is derived from the files' hashes, so placing the same files twice is a no-op and
different files give a different snapshot (refs/main moves to it last, atomically).

Run as `python -m tinkerless.functions.hf_cache [MODEL]` (scripts/install.sh does, for
SmolLM2): the converted SmolLM2 then resolves by its Hub id on this machine, for the
server and for any client on it, exactly as after a download.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
from pathlib import Path

# Files a client may need to rebuild the model or its tokenizer; caches, locks and markers stay out.
_SKIP_SUFFIXES = (".lock",)
_SKIP_NAMES = ("tinkerless-conversion.json",)


def hub_cache_dir() -> Path:
    """The Hub cache `huggingface_hub` reads: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _files(model_dir: Path) -> list[Path]:
    return sorted(
        p for p in model_dir.iterdir()
        if p.is_file() and p.name not in _SKIP_NAMES and not p.name.endswith(_SKIP_SUFFIXES) and not p.name.startswith(".")
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def place_in_hf_cache(model_dir: str | Path, repo_id: str, cache_dir: str | Path | None = None) -> Path:
    """Copy `model_dir`'s files into the Hub cache as repo `repo_id`; returns the snapshot directory."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} holds no config.json: not a saved model directory")
    if repo_id.count("/") != 1:
        raise ValueError(f"{repo_id!r} is not a Hub model id of the form owner/name")
    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    files = {path.name: _sha256(path) for path in _files(model_dir)}
    revision = hashlib.sha1("".join(f"{n}\0{h}\n" for n, h in sorted(files.items())).encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    for directory in (repo / "blobs", snapshot, repo / "refs"):
        directory.mkdir(parents=True, exist_ok=True)
    for name, digest in files.items():
        blob = repo / "blobs" / digest
        if not blob.is_file():
            _atomic_copy(model_dir / name, blob)
        link = snapshot / name
        if not link.exists():
            tmp_link = snapshot / f".{name}.{os.getpid()}.tmp"
            tmp_link.unlink(missing_ok=True)
            tmp_link.symlink_to(os.path.relpath(blob, snapshot))
            os.replace(tmp_link, link)
    _atomic_write(repo / "refs" / "main", revision.encode())
    return snapshot


def _atomic_copy(source: Path, target: Path) -> None:
    _atomic_write(target, source.read_bytes())


def _atomic_write(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install_model(spec: str = "smollm2", cache_dir: str | Path | None = None) -> tuple[str, Path]:
    """Convert (if needed) a built-in model and place it in the Hub cache under its Hub id."""
    from tinkerless.functions.models import public_model_id, resolve_model

    repo_id = public_model_id(spec)
    if repo_id.count("/") != 1:
        raise ValueError(f"{spec!r} has no Hugging Face Hub id to install it under")
    return repo_id, place_in_hf_cache(resolve_model(spec), repo_id, cache_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2", help="a built-in model (default: smollm2)")
    parser.add_argument("--cache-dir", default=None, help="the Hub cache to fill (default: huggingface_hub's)")
    args = parser.parse_args(argv)
    repo_id, snapshot = install_model(args.model, args.cache_dir)
    print(f"{repo_id} placed in the Hugging Face cache at {snapshot}")


if __name__ == "__main__":
    main()
