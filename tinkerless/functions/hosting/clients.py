"""The other clients an agent function may use on its episode's endpoint, beside the `openai` client it is given.

An agent function receives an `openai.AsyncOpenAI` client (Chat Completions and Responses, the OpenAI Agents
SDK's `OpenAIResponsesModel(model="policy", openai_client=client)`). `anthropic_client(client)` is an
`anthropic.AsyncAnthropic` on the same endpoint with the same key (the episode's), over the same transport
(in process, loopback or the sandbox's channel), so its `/v1/messages` calls are recorded into the same episode;
one episode may mix the three APIs. Outside training (`tinkerless eval --endpoint URL`) it points at that URL.

The Anthropic SDK speaks `httpx2`; the worker's transports are `httpx` ones: `bridge` carries each request
across, streaming the reply body through as it comes (SSE).
"""

from __future__ import annotations

import weakref
from typing import Any

_transports: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def register(openai_client: Any, http_client: Any) -> None:
    """Remember the `httpx.AsyncClient` an episode's openai client sends through (the worker calls this)."""
    _transports[openai_client] = http_client


def anthropic_client(client: Any, **options: Any) -> Any:
    """An `anthropic.AsyncAnthropic` on the endpoint, key and transport of the agent's `openai` client `client`.

        @tinkerless.agent
        async def solve(client, task):
            claude = tinkerless.anthropic_client(client)
            reply = await claude.messages.create(model="policy", max_tokens=64, messages=[...])
    """
    try:
        import anthropic
        import httpx2
    except ImportError as exc:  # pragma: no cover - the extra is in `dev`
        raise ImportError("tinkerless.anthropic_client needs the anthropic SDK: pip install 'tinkerless[anthropic]'") \
            from exc
    base_url = str(client.base_url).rstrip("/").removesuffix("/v1")  # the SDK adds /v1/messages
    http_client = _transports.get(client)
    if http_client is not None and "http_client" not in options:
        options["http_client"] = httpx2.AsyncClient(transport=bridge(http_client), timeout=http_client.timeout.read)
    options.setdefault("max_retries", 0)
    return anthropic.AsyncAnthropic(api_key=client.api_key, base_url=base_url, **options)


def _bridge_class():
    import httpx
    import httpx2

    class Body(httpx2.AsyncByteStream):
        def __init__(self, response: httpx.Response):
            self.response = response

        async def __aiter__(self):
            if hasattr(self.response, "_content"):  # a transport that answers whole bodies (the sandbox's channel)
                yield self.response.content
                return
            async for chunk in self.response.aiter_raw():
                yield chunk

        async def aclose(self) -> None:
            await self.response.aclose()

    class Bridge(httpx2.AsyncBaseTransport):
        """An httpx2 transport that sends through an `httpx.AsyncClient` (and its transport)."""

        def __init__(self, http_client: httpx.AsyncClient):
            self.http_client = http_client

        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            body = await request.aread()
            sent = httpx.Request(request.method, str(request.url), headers=list(request.headers.raw), content=body)
            response = await self.http_client.send(sent, stream=True)
            return httpx2.Response(response.status_code, headers=response.headers.raw, stream=Body(response),
                                   request=request)

    return Bridge


_bridge_type: Any = None


def bridge(http_client: Any) -> Any:
    """An httpx2 transport over `http_client` (an `httpx.AsyncClient`); the class is made on first use, so this
    module imports neither library until an agent asks for an Anthropic client."""
    global _bridge_type
    if _bridge_type is None:
        _bridge_type = _bridge_class()
    return _bridge_type(http_client)
