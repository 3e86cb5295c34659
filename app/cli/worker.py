"""``headscope worker``: a Celery worker for the app's jobs."""

from __future__ import annotations

import os

from headscope.app.cli.arguments import count, device, non_empty
from headscope.app.cli.errors import UsageError, argument
from headscope.app.cli.terminal import redacted


def cmd_worker(args) -> int:
    """A Celery worker for the app's jobs (needs HEADSCOPE_REDIS_URL)."""
    from headscope.app.workers import redis_url

    if not redis_url():
        raise UsageError("set HEADSCOPE_REDIS_URL to the Redis server the web front end uses, e.g. "
                         "HEADSCOPE_REDIS_URL=redis://127.0.0.1:6379/0 headscope worker")
    import redis

    try:
        redis.Redis.from_url(redis_url(), socket_connect_timeout=5).ping()
    except (redis.RedisError, ValueError) as e:
        raise UsageError(f"HEADSCOPE_REDIS_URL: cannot reach Redis at {redacted(redis_url())}: {e}") from None
    if args.device.startswith("cuda"):
        import torch

        n = torch.cuda.device_count()
        index = int(args.device.split(":")[1]) if ":" in args.device else 0
        if index >= n:
            raise UsageError(f"argument --device: {args.device} is not here ({n} CUDA device(s) found)")
    from headscope.analysis.models import DEFAULT_MODEL
    from headscope.app.server import start_worker

    if args.home:
        os.environ["HEADSCOPE_HOME"] = args.home
    with argument("--model"):  # the models load first, before the pool forks
        start_worker(models=args.model or [DEFAULT_MODEL], concurrency=args.concurrency, device=args.device,
                     name=args.name, page_concurrency=args.page_concurrency)
    return 0


def add_parser(sub) -> None:
    """``headscope worker``: the app's jobs on a Celery worker."""
    p = sub.add_parser("worker", help="run the app's jobs as a Celery worker (needs HEADSCOPE_REDIS_URL)")
    p.add_argument("--concurrency", type=count(1), default=1,
                   help="long jobs (sweeps, curves, embeddings) at once: pool processes (default 1)")
    p.add_argument("--page-concurrency", type=count(0), default=1,
                   help="page callbacks at once, beside the jobs, so a long job never blocks a page "
                        "(default 1; 0: this worker takes no page callbacks)")
    p.add_argument("--device", type=device, default="cpu", help="torch device for models, e.g. cuda:0 (default cpu)")
    p.add_argument("--model", action="append", type=non_empty("the model spec"),
                   help="model to load before the pool forks (repeatable; default: the embedded model); "
                        "the first is the default model of jobs")
    p.add_argument("--name", type=non_empty("the worker name"), help="worker name (default headscope-<pid>); "
                                                                    "unique per host")
    p.set_defaults(func=cmd_worker)
