"""The rollout loops: episodes played token in, token out, every sampled token recorded with its log-prob.

- `requests`: a rollout request served: the loop it asks for, the code its client shipped, the call's stats;
- `agent_loop`: one state machine per episode (single-turn and env episodes), batched across episodes;
- `multi_agent_loop`: games where several roles share one env, each role with its own conversation;
- `chat`: chat formatting in token space, so sampled tokens are never re-tokenized;
- `recording`: an agent function's completion calls turned into training sequences;
- `rollout_clock`: where a rollout's seconds go (generation, the env's code, encoding, decoding).
"""
