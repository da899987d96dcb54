"""OpenEnv environments as tinkerless envs, in-process or through an OpenEnv server on loopback.

    Echo = tinkerless.envs.openenv(EchoEnvironment)                 # an openenv Environment subclass, in-process
    Echo = tinkerless.envs.openenv("http://127.0.0.1:8001")         # the same env served by openenv's create_app
    tinkerless.train(env=Echo, tasks=lambda rng: {"seed": rng.randrange(10**6)}, ...)

Each episode gets its own `Environment` instance, or its own WebSocket session on the server (OpenEnv's
`GenericEnvClient`, one connection per episode, so episodes run side by side up to the server's
`max_concurrent_envs`). A task's fields are `reset(**task)`'s keyword arguments.

The model's text becomes an action against the env's action schema (the `Action` model in-process, the
server's `/schema` remotely): a JSON object in the text is the action's fields; otherwise an action with one
required text field (or one field in all) takes the whole text, and one numeric field the first number in it.
A text that does not parse, or whose fields the schema (then the action model, or the server) rejects, is not
stepped: the model gets the validation error as its next observation, with no reward, and answers again.

Observations: the observation's fields other than `done`, `reward` and `metadata`, as the text of the one text
field, or as JSON. `reward` (None is 0) and `done` come from the observation.

A dropped or unreachable server is `InfrastructureFailure(cause="env_server_unreachable")` for that episode
(retried, then dropped, never scored): the connection is closed on any failure, never read again, so a late
answer cannot be taken for the next step's (OpenEnv #1143), and the next episode connects anew. A server at its
session limit is `InfrastructureFailure(cause="env_server_capacity")`.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from typing import Any, Iterator

from tinkerless.envs.adapters._optional import require
from tinkerless.envs.base import StepResult
from tinkerless.errors import ConfigError, EnvError, InfrastructureFailure

HIDDEN_FIELDS = ("done", "reward", "metadata")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def openenv(source: Any, *, connect_attempts: int = 3, message_timeout_s: float = 60.0) -> type:
    """An env class over an OpenEnv `Environment` subclass (in-process) or a server's base URL (module docstring)."""
    require("openenv")
    if isinstance(source, str):
        if not re.match(r"^(https?|wss?)://", source):
            raise ConfigError(f"openenv takes an Environment class or a server URL, got {source!r}",
                              hint='e.g. tinkerless.envs.openenv("http://127.0.0.1:8001")')
        schema = _remote_schema(source)
        attributes = {"url": source.rstrip("/"), "action_schema": schema, "connect_attempts": connect_attempts,
                      "message_timeout_s": message_timeout_s}
        return type("OpenEnvRemote", (OpenEnvRemote,), attributes)
    Environment = require("openenv.core.env_server").Environment
    if not (isinstance(source, type) and issubclass(source, Environment)):
        raise ConfigError(f"openenv takes a subclass of openenv's Environment or a server URL, got {source!r}")
    mcp = require("openenv.core.env_server").MCPEnvironment
    if mcp is not None and issubclass(source, mcp):  # a tool env: its MCP tools become tinkerless tools
        return type(f"OpenEnvTools_{source.__name__}", (OpenEnvTools,), {"environment": source})
    action_cls = action_class(source)
    attributes = {"environment": source, "action_cls": action_cls, "action_schema": action_cls.model_json_schema()}
    return type(f"OpenEnv_{source.__name__}", (OpenEnvInProcess,), attributes)


def action_class(environment: type) -> type:
    """The env's Action model: the annotation of `step`'s `action` parameter."""
    import typing

    try:
        hints = typing.get_type_hints(environment.step)
    except Exception:
        hints = getattr(environment.step, "__annotations__", {})
    action = hints.get("action")
    if not (isinstance(action, type) and hasattr(action, "model_validate")):
        raise ConfigError(f"{environment.__name__}.step has no Action model annotation on `action`",
                          hint="annotate it: def step(self, action: MyAction, ...) -> MyObservation")
    return action


class _OpenEnvAdapter:
    action_schema: dict = {}

    def system_prompt(self) -> str:
        return describe_action(self.action_schema)

    def _result(self, observation: Any, reward: Any, done: Any) -> StepResult:
        return StepResult(observation=None if done else observation_text(observation),
                          reward=0.0 if reward is None else reward, done=bool(done))


class OpenEnvInProcess(_OpenEnvAdapter):
    """An OpenEnv `Environment` stepped in this process, one instance per episode."""

    environment: type = object
    action_cls: type = object

    def reset(self, **task: Any) -> str:
        self.env = self.environment()
        return observation_text(self.env.reset(**task))

    def step(self, action: str) -> StepResult:
        fields, problem = action_fields(str(action), self.action_schema)
        if problem is None:
            try:
                parsed = self.action_cls.model_validate(fields)
            except Exception as exc:  # pydantic's ValidationError: the model's mistake, shown to it
                problem = _validation_message(exc)
        if problem is not None:
            return StepResult(observation=problem, reward=0.0, done=False, info={"action_error": True})
        observation = self.env.step(parsed)
        if not isinstance(observation, require("openenv.core.env_server").Observation):
            raise EnvError(f"{self.environment.__name__}.step returned {type(observation).__name__}, not an OpenEnv Observation",
                           hint="return an Observation subclass (with done and reward)")
        return self._result(observation, observation.reward, observation.done)


class OpenEnvTools:
    """An OpenEnv `MCPEnvironment` in-process: its MCP tools, listed at the episode's start, are offered in
    tinkerless's tool format (`envs.tool_format`: `<tool_call>{"name", "arguments"}</tool_call>`, results as
    `<tool_response>`, `<answer>` ends the episode); each call is the env's `CallToolAction`, and the env's
    observation gives the reward and `done`. A call the model writes badly, or a tool the env does not have, is
    shown to the model as the observation; a tool that fails answers its error the same way (the env's own
    `CallToolObservation.error`)."""

    environment: type = object

    def _env(self) -> Any:
        if getattr(self, "env", None) is None:
            self.env = self.environment()
        return self.env

    def tools(self) -> list:
        if getattr(self, "_tools", None) is None:
            from tinkerless.envs.tool_schema import Tool

            types = require("openenv.core.env_server.mcp_types")
            listed = self._env().step(types.ListToolsAction())
            self._tools = [Tool(name=t.name, description=t.description or "", parameters=dict(t.input_schema or {}),
                                fn=_called_through_the_env) for t in listed.tools]
        return self._tools

    def system_prompt(self) -> str:
        from tinkerless.envs.tool_format import describe_tools

        return describe_tools(self.tools())

    def reset(self, **task: Any) -> str:
        first = self._env().reset(**task)
        self.tools()
        return observation_text(first)

    def step(self, action: str) -> StepResult:
        from tinkerless.envs import tool_format

        parsed = tool_format.parse_action(str(action))
        if isinstance(parsed, tool_format.FinalAnswer):
            return StepResult(observation=None, reward=0.0, done=True, info={"answer": parsed.text[:500]})
        if isinstance(parsed, tool_format.ParseError):
            return StepResult(observation=parsed.message, reward=0.0, done=False, info={"action_error": True})
        if parsed is None:
            return StepResult(observation='No tool call or answer found: reply <tool_call>{"name": ..., "arguments": '
                              '{...}}</tool_call> or <answer>...</answer>.', reward=0.0, done=False, info={"action_error": True})
        names = [t.name for t in self.tools()]
        if parsed.name not in names:
            return StepResult(observation=f"There is no tool {parsed.name!r}; the tools are {names}.", reward=0.0,
                              done=False, info={"action_error": True})
        types = require("openenv.core.env_server.mcp_types")
        observation = self.env.step(types.CallToolAction(tool_name=parsed.name, arguments=parsed.arguments))
        error = getattr(observation, "error", None)
        result = getattr(observation, "result", None)
        text = f"error: {getattr(error, 'message', error)}" if error else tool_format.format_result(_tool_value(result))
        done = bool(getattr(observation, "done", False))
        reward = getattr(observation, "reward", None)
        return StepResult(observation=None if done else f"<tool_response>{text}</tool_response>",
                          reward=0.0 if reward is None else reward, done=done, info={"tool": parsed.name})


def _called_through_the_env(**_: Any) -> Any:
    raise EnvError("an OpenEnv MCP tool runs through its env's step(CallToolAction), not directly")


def _tool_value(result: Any) -> Any:
    """The text or data of an MCP tool result (FastMCP's CallToolResult: `data`, or its text contents)."""
    if result is None:
        return ""
    data = getattr(result, "data", None)
    if data is not None:
        return data
    contents = getattr(result, "content", None)
    if isinstance(contents, list):
        return "\n".join(str(getattr(c, "text", c)) for c in contents)
    return result


class OpenEnvRemote(_OpenEnvAdapter):
    """An OpenEnv server reached over its WebSocket client, one session (connection) per episode."""

    url: str = ""
    connect_attempts: int = 3
    message_timeout_s: float = 60.0

    def __init__(self) -> None:
        self.client: Any = None

    def reset(self, **task: Any) -> str:
        self._close()
        generic = require("openenv.core.generic_client").GenericEnvClient
        for attempt in range(self.connect_attempts):
            try:
                self.client = generic(self.url, connect_timeout_s=5.0, message_timeout_s=self.message_timeout_s).sync()
                self.client.connect()
                break
            except Exception as exc:
                self._close()
                if attempt + 1 == self.connect_attempts:
                    raise InfrastructureFailure(f"the OpenEnv server at {self.url} is unreachable after "
                                                f"{self.connect_attempts} tries: {type(exc).__name__}: {exc}",
                                                cause="env_server_unreachable") from exc
                time.sleep(0.2 * 2**attempt)
        result = self._call("reset", task)
        return observation_text(result.observation)

    def step(self, action: str) -> StepResult:
        fields, problem = action_fields(str(action), self.action_schema)
        if problem is not None:
            return StepResult(observation=problem, reward=0.0, done=False, info={"action_error": True})
        try:
            result = self._call("step", fields)
        except _Rejected as rejected:
            return StepResult(observation=rejected.message, reward=0.0, done=False, info={"action_error": True})
        if result.done:
            self._close()  # frees the server's session for the next episode
        return self._result(result.observation, result.reward, result.done)

    def _call(self, method: str, payload: dict) -> Any:
        if self.client is None:
            raise InfrastructureFailure(f"the OpenEnv session with {self.url} was closed", cause="env_server_unreachable")
        try:
            return self.client.reset(**payload) if method == "reset" else self.client.step(payload)
        except RuntimeError as exc:  # the server's error answer: {"type": "error", "data": {"code": ...}}
            text = str(exc)
            if "VALIDATION_ERROR" in text:  # what the schema check let through and the server's model did not
                raise _Rejected(f"The action was rejected: {text}. {describe_action(self.action_schema)}") from exc
            self._close()
            if "CAPACITY_REACHED" in text:
                raise InfrastructureFailure(f"the OpenEnv server at {self.url} is at its session limit: {text}",
                                            cause="env_server_capacity",
                                            hint="run fewer episodes at once (batch_size x group_size) or raise the "
                                                 "server's max_concurrent_envs") from exc
            raise EnvError(f"the OpenEnv env at {self.url} failed in {method}: {text}") from exc
        except Exception as exc:  # closed socket, timeout, refused: the session is gone, never read again
            refusal = self._refusal() if method == "reset" else None
            self._close()
            if refusal is not None and "CAPACITY_REACHED" in refusal:
                raise InfrastructureFailure(f"the OpenEnv server at {self.url} is at its session limit: {refusal}",
                                            cause="env_server_capacity",
                                            hint="run fewer episodes at once (batch_size x group_size) or raise the "
                                                 "server's max_concurrent_envs") from exc
            raise InfrastructureFailure(f"the OpenEnv server at {self.url} dropped the episode in {method}: "
                                        f"{type(exc).__name__}: {exc}", cause="env_server_unreachable") from exc

    def _refusal(self) -> str | None:
        """The error a server sends as it turns a new session away (then it closes before our first message
        lands); it waits in the closed socket's buffer."""
        try:
            message = self.client._run(self.client.async_client._receive())
        except Exception:
            return None
        return json.dumps(message) if isinstance(message, dict) and message.get("type") == "error" else None

    def _close(self) -> None:
        client, self.client = getattr(self, "client", None), None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def __del__(self) -> None:
        self._close()


class _Rejected(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


# --- actions and observations as text --------------------------------------------------------------------------


def action_fields(text: str, schema: dict) -> tuple[dict, str | None]:
    """The action's fields read from the model's text and checked against the schema, or the problem to show
    the model. The same check runs in-process and remotely, so both show the model the same words."""
    fields, problem = _read_fields(text, schema)
    if problem is None:
        import jsonschema

        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(fields), key=lambda e: list(e.path))
        if errors:
            problem = "The action was rejected: " + "; ".join(
                f"{'.'.join(str(p) for p in e.path) or 'action'}: {e.message}" for e in errors[:5]) + f". {describe_action(schema)}"
    return fields, problem


def _read_fields(text: str, schema: dict) -> tuple[dict, str | None]:
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k not in HIDDEN_FIELDS}
    required = [k for k in schema.get("required") or [] if k in properties]
    found = _json_object(text)
    if found is not None:
        return found, None
    single = required[0] if len(required) == 1 else (next(iter(properties)) if len(properties) == 1 else None)
    kind = _kind(properties.get(single, {})) if single else None
    if kind == "string":
        return {single: text.strip()}, None
    if kind in ("integer", "number"):
        number = NUMBER.search(text)
        if number:
            value = number.group(0)
            return {single: int(float(value)) if kind == "integer" else float(value)}, None
        return {}, f"No number found in your answer. {describe_action(schema)}"
    return {}, f"Your answer is not an action. {describe_action(schema)}"


def describe_action(schema: dict) -> str:
    properties = {k: v for k, v in (schema.get("properties") or {}).items() if k not in HIDDEN_FIELDS}
    fields = ", ".join(f'"{k}": {_kind(v) or "value"}' + (f" ({v['description']})" if v.get("description") else "")
                       for k, v in properties.items())
    return f"Answer with a JSON object of the action's fields: {{{fields}}}."


def observation_text(observation: Any) -> str:
    """An observation (a pydantic model or the server's dict) as the text the model reads."""
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump()
    if isinstance(observation, dict):
        shown = {k: v for k, v in observation.items() if k not in HIDDEN_FIELDS}
        if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
            return next(iter(shown.values()))
        return json.dumps(shown, sort_keys=True, default=str)
    return str(observation)


def _kind(field: dict) -> str | None:
    if "type" in field:
        return field["type"] if isinstance(field["type"], str) else None
    kinds = [o.get("type") for o in field.get("anyOf", []) if o.get("type") != "null"]
    return kinds[0] if len(kinds) == 1 else None


def _json_object(text: str) -> dict | None:
    start = text.find("{")
    while start != -1:
        try:
            value, _ = json.JSONDecoder().raw_decode(text[start:])
            if isinstance(value, dict):
                return value
        except ValueError:
            pass
        start = text.find("{", start + 1)
    return None


def _validation_message(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors()[:5]]
        return "The action was rejected: " + "; ".join(parts)
    return f"The action was rejected: {exc}"


def _remote_schema(url: str) -> dict:
    import httpx

    try:
        response = httpx.get(url.rstrip("/").replace("ws://", "http://").replace("wss://", "https://") + "/schema", timeout=10.0)
        response.raise_for_status()
        return response.json()["action"]
    except Exception as exc:
        raise InfrastructureFailure(f"could not read the action schema of the OpenEnv server at {url}: "
                                    f"{type(exc).__name__}: {exc}", cause="env_server_unreachable",
                                    hint="start the server first (openenv's create_app under uvicorn)") from exc


# --- serving an Environment on loopback (tests, benchmarks, and users who want the server path locally) --------


@contextlib.contextmanager
def serve(environment: type, *, max_concurrent_envs: int = 8, port: int = 0) -> Iterator[str]:
    """Serve `environment` with openenv's `create_fastapi_app` on 127.0.0.1 (a free port by default); yields its URL."""
    import uvicorn

    create_fastapi_app = require("openenv.core.env_server").create_fastapi_app
    action_cls = action_class(environment)
    observation_cls = _observation_class(environment)
    app = create_fastapi_app(environment, action_cls, observation_cls, max_concurrent_envs=max_concurrent_envs)
    if not port:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws_ping_interval=None))
    thread = threading.Thread(target=server.run, name=f"openenv-{environment.__name__}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        raise InfrastructureFailure(f"the OpenEnv server for {environment.__name__} did not start", cause="env_server_unreachable")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _observation_class(environment: type) -> type:
    import typing

    hints = typing.get_type_hints(environment.step)
    observation = hints.get("return")
    if not (isinstance(observation, type) and hasattr(observation, "model_validate")):
        raise ConfigError(f"{environment.__name__}.step has no Observation return annotation",
                          hint="annotate it: def step(self, action: MyAction, ...) -> MyObservation")
    return observation
