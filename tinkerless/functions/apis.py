"""The APIs beside Chat Completions, each over the same `CompletionBackend`: one list for every place that mounts them.

`tinkerless serve` (`server/app.py`) and the rollout worker's per-rollout endpoint (`hosting.agent_functions`)
include these routers next to `openai_api.openai_router`, so an API added here is served by both.
"""

from __future__ import annotations

from typing import Callable

from fastapi import APIRouter, Request

from tinkerless.functions.openai_api.calls import MAX_BODY_BYTES


def api_routers(backend, *, caller: Callable[[Request], str | None], max_body_bytes: int = MAX_BODY_BYTES) -> list[APIRouter]:
    """Anthropic Messages (`/v1/messages`) and OpenAI Responses (`/v1/responses`) over `backend`."""
    from tinkerless.functions.anthropic_api import messages_router
    from tinkerless.functions.responses_api import responses_router

    return [messages_router(backend, caller=caller, max_body_bytes=max_body_bytes),
            responses_router(backend, caller=caller, max_body_bytes=max_body_bytes)]
