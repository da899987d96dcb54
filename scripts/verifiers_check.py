"""Drive `tinkerless serve`'s token route with verifiers 0.4's own training client (run by verifiers_check.sh).

Runs in .venv-verifiers (verifiers pins openai and mcp versions the tinkerless venv does not take). A
two-turn conversation goes through `verifiers.v1.clients.train.TrainClient.get_response`, the call verifiers'
interception server makes for every model turn of an episode: it renders the chat with the model's template
(`renderers`), posts to `/inference/v1/generate` and reads back token ids and log-probs. The second turn
carries the first's reply, as an episode's next turn does. Checks: ids and log-probs of equal length, every
log-prob finite and <= 0, the prompt ids the chat template's, the decoded text the ids'.

    python scripts/verifiers_check.py BASE_URL MODEL_DIR   # $TINKERLESS_API_KEY holds the key
"""

import asyncio
import math
import sys

from transformers import AutoTokenizer
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.types import SamplingConfig


async def main(base_url: str, model_dir: str) -> None:
    client = TrainClient(TrainClientConfig(base_url=base_url, api_key_var="TINKERLESS_API_KEY",
                                           renderer_model_name=model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    served = (await client.client.models.list()).data[0].id  # the base model's name on the server
    messages = [{"role": "user", "content": "Name a colour. Answer with one word."}]
    try:
        for turn in range(2):
            body = {"model": served, "messages": messages}
            response = await client.get_response(ChatDialect(), body, SamplingConfig(max_tokens=12, temperature=1.0))
            tokens = response.tokens
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            template = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            assert tokens.completion_ids and len(tokens.completion_ids) == len(tokens.completion_logprobs), tokens
            assert all(math.isfinite(lp) and lp <= 0 for lp in tokens.completion_logprobs), tokens.completion_logprobs
            assert list(tokens.prompt_ids) == template, (tokens.prompt_ids, template)
            text = tokenizer.decode(tokens.completion_ids, skip_special_tokens=True)
            assert (response.message.content or "").strip() == text.strip(), (response.message.content, text)
            print(f"turn {turn}: {len(tokens.prompt_ids)} prompt ids, {len(tokens.completion_ids)} sampled "
                  f"({response.finish_reason}), log-probs {[round(x, 3) for x in tokens.completion_logprobs]}: {text!r}")
            messages = messages + [{"role": "assistant", "content": response.message.content or ""},
                                   {"role": "user", "content": "Another one."}]
    finally:
        await client.close()
    print("verifiers TrainClient: ok")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
