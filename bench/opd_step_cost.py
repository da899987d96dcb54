"""What an OPD step costs beside an RL step, in the same run: RL 8 x 4, OPD 8 x 1 (the cookbook's one sample per
prompt: OPD needs no group baseline), OPD 8 x 4, then RL again (the baseline twice, for the load's drift).

    python bench/opd_step_cost.py --teacher-storage /tmp/opd_vs_rl    # needs bench/opd_vs_rl.py's RL run (rl@20)

Each side trains 3 steps from the base model on the main job (bench/opd_vs_rl.py's config) with the teacher
`rl@20` copied from --teacher-storage; the first step is warm-up and left out. Per step: seconds, trained
sequences and tokens, and the teacher, update and rollout phases.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import tinkerless  # noqa: E402
from bench.opd_vs_rl import config  # noqa: E402

SIDES = {"rl": {}, "opd8x1": dict(reward=None, teacher="rl@20", group_size=1),
         "opd8x4": dict(reward=None, teacher="rl@20"), "rl_again": {}}
COLUMNS = ("step_s", "trained_tokens", "trained_sequences", "compute_s/teacher", "compute_s/update", "compute_s/rollout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher-storage", default="/tmp/opd_vs_rl")
    parser.add_argument("--storage", default="/tmp/opd_step_cost")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    shutil.rmtree(args.storage, ignore_errors=True)
    shutil.copytree(Path(args.teacher_storage, "runs", "rl"), Path(args.storage, "runs", "rl"))
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": "2-core CPU, shared with other jobs"}
    for name, changes in SIDES.items():
        run = tinkerless.train(config(args.storage, run_id=f"cost-{name}", steps=args.steps, checkpoint_every=args.steps,
                                      keep_checkpoints=1, **changes))
        result[name] = {k: [round(r.get(k) or 0.0, 3) for r in run.metrics[1:]] for k in COLUMNS}
        print(name, result[name], flush=True)
    path = Path(args.out) / f"opd_step_cost-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
