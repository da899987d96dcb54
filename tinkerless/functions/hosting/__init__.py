"""Hosting users' code next to the model: tenants' envs, rewards and agents, behind the sandbox.

- `user_code`: on a shared server, a tenant's code runs in its own bubblewrap sandbox, never in the server;
- `user_code_host` / `user_code_protocol`: the sandboxed side of that pipe and what crosses it;
- `agent_functions`: `@tinkerless.agent` copies against the policy through an OpenAI endpoint per rollout;
- `hosted_agents` / `agent_host`: those copies inside the tenant's sandbox, the model staying here;
- `agent_channel` / `agent_channel_server`: the checked channel from a sandboxed agent back to the model.
- `clients`: the Anthropic client an agent may use beside its OpenAI one, on the same episode and transport;
- `external_agents`: agents in another process or language, through the rollout's capture endpoint.
"""
