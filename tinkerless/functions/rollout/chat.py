"""Chat formatting in token space, so sampled tokens are never re-tokenized.

The first prompt is rendered with the tokenizer's chat template. Later
observations are appended as the template's *delta*: the text the template
adds after an assistant turn for a new user message plus the next
generation prompt, found once by rendering a probe conversation.

The token that closes an assistant turn (`end_of_turn_id`) is read from the
same probe: it is the special token the template writes right after a reply
(`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3, `<end_of_turn>` for Gemma).
A turn the model closed itself already holds it; a turn cut at max_tokens gets
it inserted (mask 0), so every multi-turn context equals `apply_chat_template`
of the same messages. A model whose end of turn cannot be determined, or whose
tokenizer's EOS is a token the template uses for something else, is refused.
"""

from __future__ import annotations

from tinkerless.errors import ConfigError
from tinkerless.functions.rollout.rollout_clock import measure

_PROBE_REPLY = "\u2063probe-reply\u2063"
_PROBE_OBSERVATION = "\u2063OBS\u2063"


class ChatFormat:
    def __init__(self, tokenizer, generation_config=None):
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self._after_reply = self._probe_after_reply() if self.has_template else ""
        self.template_closes_turns = False  # set by _end_of_turn: the template itself writes the closing token
        # The closing token of an assistant turn and every id that ends a sampled turn (the sampler's stop ids).
        self.end_of_turn_id, self.eos_token_ids = self._end_of_turn(generation_config)
        self._observation_prefix, self._observation_suffix = self._observation_frame()

    # ---- rendering ---------------------------------------------------------------
    def render(self, messages: list[dict]) -> str:
        if self.has_template:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # Base models without a template: a plain transcript.
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nassistant:"

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        with measure("encode"):  # rendering the template is part of encoding
            return self.encode(self.render(messages))

    def encode(self, text: str) -> list[int]:
        with measure("encode"):
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        """A sampled turn's text (special tokens left out)."""
        with measure("decode"):
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def observation_tokens(self, observation: str, *, last_token: int | None) -> list[int]:
        """Tokens that follow a sampled turn: end-of-turn (if the model did not emit it), the user message, the next generation prompt.

        `last_token` is the turn's last sampled id (None for an empty turn). Only the template's own end-of-turn
        token closes the turn; a turn cut at max_tokens, or ended by another stop id (e.g. `<|endoftext|>`), gets
        the end-of-turn token appended, as the template would write it.
        """
        tokens = self.encode(self._observation_prefix + observation + self._observation_suffix)
        if self.template_closes_turns and last_token != self.end_of_turn_id:
            tokens = [self.end_of_turn_id] + tokens
        return tokens

    # ---- what the template and configs say -----------------------------------------
    def _probe_after_reply(self) -> str:
        """The template's text between an assistant reply and the next generation prompt (with a user message)."""
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": _PROBE_REPLY},
            {"role": "user", "content": _PROBE_OBSERVATION},
        ]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template that cannot render a plain user/assistant/user exchange
            raise ConfigError(
                f"the model's chat template cannot render a user/assistant/user conversation: {type(exc).__name__}: {exc}",
                hint="use a chat model whose template supports multi-turn conversations, or a tokenizer without a chat_template",
            ) from exc
        if _PROBE_REPLY not in text or _PROBE_OBSERVATION not in text:
            raise ConfigError(
                "the model's chat template drops message contents, so turns cannot be rendered in token space",
                hint="use a chat model whose template writes every message's content",
            )
        return text[text.rindex(_PROBE_REPLY) + len(_PROBE_REPLY) :]

    def _end_of_turn(self, generation_config) -> tuple[int | None, list[int]]:
        tokenizer = self.tokenizer
        configured = _ids(getattr(generation_config, "eos_token_id", None)) if generation_config is not None else []
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in configured:
            configured.append(tokenizer.eos_token_id)
        template_token = _leading_special_token(tokenizer, self._after_reply) if self.has_template else None
        self.template_closes_turns = template_token is not None  # then a cut turn gets the token inserted
        if template_token is not None:
            end_of_turn = tokenizer.convert_tokens_to_ids(template_token)
            opening = self._turn_opening_ids()
            wrong = [i for i in configured if i in opening and i != end_of_turn]
            if wrong:
                names = [tokenizer.convert_ids_to_tokens(i) for i in wrong]
                raise ConfigError(
                    f"the model's EOS token {names} is a token its chat template uses to open turns, while the template "
                    f"ends a reply with {template_token!r}: sampling would stop at the start of a new turn",
                    hint=f"set eos_token to {template_token!r} in tokenizer_config.json and eos_token_id in "
                    "generation_config.json / config.json",
                )
            return end_of_turn, sorted({end_of_turn, *configured})
        if configured:
            # No closing token in the template (or no template): the configured EOS ends a turn; the template's
            # own text (if any) separates turns.
            return configured[0], sorted(configured)
        raise ConfigError(
            "cannot determine the model's end-of-turn token: its chat template writes no special token after an "
            "assistant reply, and neither the tokenizer nor the generation config sets an EOS token",
            hint="set eos_token in tokenizer_config.json (and eos_token_id in generation_config.json) to the token "
            "that ends the model's replies",
        )

    def _turn_opening_ids(self) -> set[int]:
        """Special tokens the template writes to open the next turn (e.g. ChatML's `<|im_start|>`)."""
        tail = self._after_reply.split(_PROBE_OBSERVATION, 1)[0]
        specials = {t: i for t, i in _special_tokens(self.tokenizer).items() if t in tail}
        end = _leading_special_token(self.tokenizer, self._after_reply)
        return {i for t, i in specials.items() if t != end}

    def _observation_frame(self) -> tuple[str, str]:
        if not self.has_template:
            return "\nuser: ", "\nassistant:"
        # Everything between the reply and the next generation prompt, minus the end-of-turn token the model
        # samples itself (observation_tokens inserts it when the model did not).
        between = self._after_reply
        end = _leading_special_token(self.tokenizer, between)
        if end is not None:
            between = between[between.index(end) + len(end) :]
        prefix, _, suffix = between.partition(_PROBE_OBSERVATION)
        return prefix, suffix


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple, set)) else [int(value)]


def _special_tokens(tokenizer) -> dict[str, int]:
    """Every special (never split) token's text -> id: the declared specials and added special tokens."""
    out = {t: tokenizer.convert_tokens_to_ids(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            out[str(added)] = token_id
    return {t: i for t, i in out.items() if t and isinstance(i, int)}


def _leading_special_token(tokenizer, text: str) -> str | None:
    """The special token at the start of `text` (after whitespace), longest match first; None if there is none."""
    stripped = text.lstrip()
    for token in sorted(_special_tokens(tokenizer), key=len, reverse=True):
        if stripped.startswith(token):
            return token
    return None
