"""The client side: decorators, run config, task sources, the training loop and the CLI.

- `decorators`: `@env`, `@reward`, `@agent` (+ `AgentResult`); `agent_eval`: an agent against any OpenAI endpoint;
- `config.TrainConfig`: every run setting, validated up front;
- `tasks.TaskSource`: static lists, JSONL files, generator functions;
- `advantages`: group-relative advantage estimators (GRPO, Dr.GRPO);
- `client.TrainingClient`: Tinker-style primitives against any backend;
- `backends`: where functions run (`local` in-process, through the wire codec;
  `http_backend` on a `tinkerless serve` server);
- `run_host`: where a run's coordinator and checkpoints live (`storage`, or the server: `server_runs`);
- `trainer.train`: the RL loop; `metrics`: JSONL + PNG; `cli`: `tinkerless train|runs|eval`.
"""
