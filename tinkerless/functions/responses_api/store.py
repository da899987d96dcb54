"""Earlier responses, by id, for `previous_response_id`: in memory, for a server's (or a rollout's) lifetime.

A stored response is the conversation it ended (its input, previous responses' included, without instructions)
and its output as a chat message. Each is its caller's: another caller's id reads as one that does not exist.
`store: false` responses are not kept. The oldest go first past `capacity` (a bound on memory, not a promise).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tinkerless.functions.openai_api.backend import OpenAIError

CAPACITY = 4096


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._kept: OrderedDict[tuple[str, str], list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, caller: str, response_id: str, conversation: list[dict]) -> None:
        with self._lock:
            self._kept[(caller, response_id)] = conversation
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def conversation(self, caller: str, response_id: str) -> list[dict]:
        """The conversation a response ended (a copy), or the 404 OpenAI answers for an unknown id."""
        with self._lock:
            kept = self._kept.get((caller, response_id))
            if kept is not None:
                self._kept.move_to_end((caller, response_id))
        if kept is None:
            raise OpenAIError(f"Previous response with id {response_id[:200]!r} not found.", status=404,
                              param="previous_response_id", code="previous_response_not_found",
                              hint="responses are kept in memory for the server's lifetime, unless sent with "
                                   "store: false")
        return [dict(message) for message in kept]
