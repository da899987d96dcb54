"""The client side: what a user runs on a laptop, driving the functions wherever they run.

- `config.TrainConfig`: every run setting, validated up front (`config_reference`: the generated reference);
- `run/`: one RL run: the loop (`trainer.train`), tasks, advantages, metrics, transcripts, progress, accounting,
  stopping and heartbeats, and who plays a multi-agent env;
- `backends/`: where the functions run (`local` in-process through the wire codec, `http` on a
  `tinkerless serve`, Modal and SkyPilot by name), `TrainingClient`, and where a run's state lives (`run_host`);
- `sft/`: supervised fine-tuning; `evaluation/`: eval, pass@k, an agent against any endpoint;
- `checkpoints/`: naming a saved policy, exporting it, warm-starting from it;
- `tracking/`: W&B, TensorBoard and MLflow (`report_to`), fed from this process;
- `cli/`: the `tinkerless` command.
The decorators users write (`@env`, `@reward`, `@agent`) are `tinkerless.envs.decorators`.
"""
