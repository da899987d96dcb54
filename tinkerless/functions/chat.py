"""Chat formatting in token space, so sampled tokens are never re-tokenized.

The first prompt is rendered with the tokenizer's chat template. Later
observations are appended as the template's *delta*: the text the template
adds after an assistant turn for a new user message plus the next
generation prompt, found once by rendering a probe conversation.
"""

from __future__ import annotations

_PROBE_REPLY = "\u2063probe-reply\u2063"


class ChatFormat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_ids = self._eos_ids()
        self._observation_prefix, self._observation_suffix = self._observation_frame()

    def _eos_ids(self) -> list[int]:
        ids = set()
        for token in (self.tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            if token is None:
                continue
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id:
                ids.add(token_id)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def render(self, messages: list[dict]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # Base models without a template: a plain transcript.
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nassistant:"

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _observation_frame(self) -> tuple[str, str]:
        if not getattr(self.tokenizer, "chat_template", None):
            return "\nuser: ", "\nassistant:"
        user = {"role": "user", "content": "hi"}
        assistant = {"role": "assistant", "content": _PROBE_REPLY}
        marker = "\u2063OBS\u2063"
        text = self.tokenizer.apply_chat_template(
            [user, assistant, {"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
        )
        # Everything between the reply and the next generation prompt, minus the
        # end-of-turn token the model samples itself.
        between = text[text.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
        eos_text = self.tokenizer.eos_token or ""
        if eos_text and between.startswith(eos_text):
            between = between[len(eos_text):]
        prefix, _, suffix = between.partition(marker)
        return prefix, suffix

    def observation_tokens(self, observation: str, *, ended_with_eos: bool) -> list[int]:
        """Tokens that follow a sampled turn: end-of-turn (if the model did not emit it), the user message, the next generation prompt."""
        text = self._observation_prefix + observation + self._observation_suffix
        tokens = self.encode(text)
        if not ended_with_eos and self.tokenizer.eos_token_id is not None:
            tokens = [self.tokenizer.eos_token_id] + tokens
        return tokens
