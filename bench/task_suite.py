"""The long-context task suite's uncompressed answer rates on the embedded model.

For every task of :data:`headscope.analysis.long_context_tasks.TASKS` and every length, builds
``--per-task`` prompts (seed ``--seed``), greedy-decodes each with the uncompressed model and prints one
row per task and length: answered / n, the rate with its 95 % Wilson interval, and the seconds per
prompt. These are the rates :func:`headscope.analysis.long_context_tasks.doable` compares with its
``min_rate`` (default 0.5) to drop a task before a compression is scored on it.

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/task_suite.py --lengths 1024,2048 --per-task 10 \
        | tee bench/results/task_suite_answer_rates_cpu_<date>.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--per-task", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default="")
    args = parser.parse_args()

    import torch

    from headscope.analysis.long_context_tasks import (
        TASKS,
        answered,
        max_new_tokens_for,
        rates_of,
        task_prompts,
    )
    from headscope.analysis.models import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tasks = [t for t in args.tasks.split(",") if t] or list(TASKS)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = load_model(args.model)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    print(f"# task suite answer rates, uncompressed: {model.name} on {platform.machine()} CPU, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} at start, commit {commit}")
    print(f"# {args.per_task} prompts per task and length, seed {args.seed}; answered = ROUGE-1 recall of the "
          "answer > 0.5 in the greedy continuation")
    head = f"{'task':<18} {'length':>6} {'tokens':>7} {'new':>4} {'answered':>9}  {'rate [95% Wilson]':<24} {'s/prompt':>8}"
    print(head)
    print("-" * len(head))
    for task in tasks:
        for length in lengths:
            prompts = task_prompts(model, [task], [length], args.per_task, seed=args.seed)
            steps = max_new_tokens_for(prompts)
            t0 = time.perf_counter()
            outcomes = answered(model, prompts, steps)
            seconds = (time.perf_counter() - t0) / len(prompts)
            rate = rates_of(prompts, outcomes)[task]
            tokens = max(p.n_tokens for p in prompts)
            print(f"{task:<18} {length:>6} {tokens:>7} {steps:>4} {rate.successes:>4} / {rate.n:<2}  "
                  f"{rate.text():<24} {seconds:>8.1f}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
