"""The tasks of a single-turn rollout, checked at the boundary (`validate.validate` calls it): they become
chat-template input, so a task's `messages` are {role, content} maps whose content parts (`content.to_parts`) and
`images` (`content.image_part`) are checked under the limits a server enforces."""

from __future__ import annotations

from typing import Any

from tinkerless.wire.content import MAX_IMAGES_PER_MESSAGE, image_part, to_parts
from tinkerless.wire.value_rules import fail as _fail


MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_single_turn_tasks(request: Any) -> None:
    """A single-turn rollout's tasks become chat-template input: a task's 'messages' must be a list of
    {role, content} maps (a missing prompt is the agent loop's `DatasetError`; an env's or agent's tasks are
    its own keyword arguments, unchecked here)."""
    from tinkerless.wire import messages as m

    if not isinstance(request, m.RolloutRequest) or request.env is not None or request.agent is not None:
        return
    for i, task in enumerate(request.tasks):
        path = f"RolloutRequest.tasks[{i}]"
        if not isinstance(task, dict):
            _fail(path, f"must be a map, got {type(task).__name__}")
        if "messages" in task:
            messages = task["messages"]
            if not isinstance(messages, list) or not messages:
                _fail(f"{path}['messages']", "must be a non-empty list of messages")
            for j, message in enumerate(messages):
                where = f"{path}['messages'][{j}]"
                if not isinstance(message, dict):
                    _fail(where, f"must be a message map with 'role' and 'content', got {type(message).__name__}")
                if message.get("role") not in MESSAGE_ROLES:
                    _fail(f"{where}['role']", f"is {str(message.get('role'))[:40]!r}, not one of {', '.join(MESSAGE_ROLES)}")
                if not isinstance(message.get("content"), (str, list)):
                    _fail(f"{where}['content']", "must be a string or a list of content parts")
                to_parts(message["content"], f"{where}['content']")
        if "images" in task:
            images = task["images"]
            if not isinstance(images, list):
                _fail(f"{path}['images']", "must be a list of images", "send images=[...] beside the prompt")
            if len(images) > MAX_IMAGES_PER_MESSAGE:
                _fail(f"{path}['images']", f"holds {len(images)} images, more than {MAX_IMAGES_PER_MESSAGE} in one message",
                      f"send at most {MAX_IMAGES_PER_MESSAGE} images per task")
            for j, image in enumerate(images):
                image_part(image, f"{path}['images'][{j}]")
