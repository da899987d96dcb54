"""One rank's process: join the process group, build its `RankWorker`, serve the requests its pipe brings.

Started by `ShardedWorker` (`group.py`) with the spawn method (CUDA cannot be forked into). The pipe carries
`(method, payload)` requests, each to every rank, and `(ok, reply)` back: rank 0's encoded reply, or any rank's
`ErrorReply`, and otherwise nothing (the other ranks' results went to rank 0 through the process group).
A closed pipe (the parent is gone) or None ends the process.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable

from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import ErrorReply


def rank_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    model: str,
    device_kind: str,
    options: dict[str, Any],
    hook: Callable[[Any], None] | None,
    timeout_s: float,
) -> None:
    # The sampling fast path keeps views of layer weights, which FSDP2 swaps on every gather; ranks never sample.
    os.environ["TINKERLESS_LEAN_LORA"] = "0"
    try:
        worker = _start(rank, world_size, port, model, device_kind, options, timeout_s)
        if hook is not None:
            hook(worker)
        conn.send((True, encode_message({**worker.info(), "vocab_size": worker.vocab_size}) if rank == 0 else b""))
    except BaseException:  # noqa: BLE001 - the driver reports it, naming this rank
        conn.send((False, traceback.format_exc()))
        return
    _serve(rank, worker, conn)


def _start(rank: int, world_size: int, port: int, model: str, device_kind: str, options: dict, timeout_s: float):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tinkerless.functions.sharding.rank import RankWorker

    cuda = device_kind == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    # The timeout bounds every collective: a rank whose peer died fails its call instead of waiting forever
    # (the driver notices the death first and ends the group; this is the second wall).
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s), **({"device_id": torch.device("cuda", rank)} if cuda else {}),
    )
    mesh = init_device_mesh(device_kind, (world_size,))
    # Results (metrics, log-probs) are Python objects, gathered over a CPU group beside NCCL's.
    group = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    device = f"cuda:{rank}" if cuda else "cpu"
    return RankWorker(model, rank=rank, world_size=world_size, mesh=mesh, group=group, device=device, **options)


def _serve(rank: int, worker: Any, conn: Connection) -> None:
    import torch.distributed as dist

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            break
        if message is None:
            break
        method, payload = message
        reply = worker.handle(method, payload)
        failed = isinstance(decode_message(reply), ErrorReply)
        conn.send((not failed, reply if rank == 0 or failed else b""))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
