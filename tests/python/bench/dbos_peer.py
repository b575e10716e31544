"""The benchmark's durable peer on Postgres: DBOS Transact doing Fenceline's one-step job.

Each task is one DBOS workflow with one step, which posts once to the fake provider
(`POST /v1/operations`) with the workflow id as its `Idempotency-Key`. Concurrent
clients in this process enqueue the workflows through a DBOS queue under their
workflow id (`DBOSClient.enqueue`), holding at most --window tasks between submission
and the workflow's success, as Fenceline's benchmark holds tasks between submit and
`succeeded` (docs/performance.md). One worker process per core runs them (DBOS
launched in each, the queue polled every --poll-ms, --concurrency workflows at once
per process); the system database is the database --dsn names, on the benchmark's
Postgres. Prints one JSON object: the settings, tasks done, the sustained rate over the
measured window, and p50/p99/p99.9 from submission to the provider's call (its call
log) and to the workflow's success (`workflow_status.updated_at`).

    python dbos_peer.py --dsn postgresql://... --provider http://127.0.0.1:PORT --seconds 60
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peer_figures  # noqa: E402

QUEUE = "bench"
APPLICATION = "fenceline-bench"
WORKFLOW = "one_step_task"


def dbos_url(dsn: str) -> str:
    """The system database's URL as SQLAlchemy wants it (psycopg 3)."""
    return "postgresql+psycopg://" + dsn.split("://", 1)[1]


def worker(dsn: str, provider: str, poll_ms: int, concurrency: int, done, stop, ready) -> None:
    """Runs the queue's workflows until `stop`, counting each one that finished."""
    import httpx
    from dbos import DBOS, DBOSConfig

    http = httpx.Client(base_url=provider, timeout=10.0, limits=httpx.Limits(max_connections=concurrency))
    config: DBOSConfig = {
        "name": APPLICATION,
        "system_database_url": dbos_url(dsn),
        "sys_db_pool_size": concurrency + 8,
        "log_level": "WARNING",
        "executor_id": f"worker-{os.getpid()}",
    }
    DBOS(config=config)

    @DBOS.step(retries_allowed=True, max_attempts=3)
    def render(key: str) -> str:
        answer = http.post(
            "/v1/operations",
            json={"operation": "render", "input": {"task": {"bench": key}}},
            headers={"Idempotency-Key": key},
        )
        answer.raise_for_status()
        return answer.json()["request_id"]

    @DBOS.workflow(name=WORKFLOW)
    def one_step_task() -> str:
        request_id = render(DBOS.workflow_id)
        with done.get_lock():
            done.value += 1
        return request_id

    DBOS.launch()
    DBOS.register_queue(QUEUE, worker_concurrency=concurrency, polling_interval_sec=poll_ms / 1000)
    ready.release()
    stop.wait()
    DBOS.destroy(workflow_completion_timeout_sec=0)


def produce(client, seconds: float, clients: int, window: int, done) -> tuple[dict[str, float], list[float], float, float]:
    """Enqueues from `clients` threads for `seconds`; returns each key's submission instant."""
    submitted: dict[str, float] = {}
    enqueue_ms: list[float] = []
    lock = threading.Lock()
    sent = 0
    started = time.time()
    deadline = started + seconds

    def one_client(index: int) -> None:
        nonlocal sent
        n = 0
        while time.time() < deadline:
            while True:
                with lock:
                    if sent - done.value < window:
                        sent += 1
                        break
                time.sleep(0.001)
            n += 1
            key = f"dbos-{index}-{n}"
            at = time.time()
            client.enqueue({"queue_name": QUEUE, "workflow_name": WORKFLOW, "workflow_id": key})
            with lock:
                submitted[key] = at
                enqueue_ms.append((time.time() - at) * 1e3)

    threads = [threading.Thread(target=one_client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return submitted, enqueue_ms, started, deadline


def succeeded_at(dsn: str) -> dict[str, float]:
    """When each workflow reached SUCCESS, in seconds since the epoch."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT workflow_uuid, updated_at FROM dbos.workflow_status WHERE status = 'SUCCESS'"
        ).fetchall()
    return {key: at / 1e3 for key, at in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True, help="the system database (one of its own)")
    parser.add_argument("--provider", required=True, help="the fake provider's base URL")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--window", type=int, default=400)
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds left out of the sustained rate")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--poll-ms", type=int, default=50, help="how often each worker polls the queue")
    parser.add_argument("--concurrency", type=int, default=64, help="workflows at once per worker")
    parser.add_argument("--drain-seconds", type=float, default=60.0)
    args = parser.parse_args()

    peer_figures.wait_ready(args.provider)
    context = multiprocessing.get_context("spawn")
    done, stop, ready = context.Value("q", 0), context.Event(), context.Semaphore(0)
    workers = []
    for n in range(args.workers):
        process = context.Process(
            target=worker, args=(args.dsn, args.provider, args.poll_ms, args.concurrency, done, stop, ready)
        )
        process.start()
        workers.append(process)
        # The first one creates the system database's schema; the others wait for it.
        if n == 0 and not ready.acquire(timeout=120):
            raise SystemExit("the first DBOS worker did not start")
    for _ in workers[1:]:
        if not ready.acquire(timeout=120):
            raise SystemExit("a DBOS worker did not start")

    from dbos import DBOSClient

    client = DBOSClient(
        system_database_url=dbos_url(args.dsn), application_name=APPLICATION, system_database_pool_size=args.clients + 2
    )
    commits_before = peer_figures.commits(args.dsn)
    submitted, enqueue_ms, started, ended = produce(client, args.seconds, args.clients, args.window, done)
    limit = time.time() + args.drain_seconds
    while done.value < len(submitted) and time.time() < limit:
        time.sleep(0.05)
    client.destroy()
    # The last workflows' status writes commit just after the step's count.
    time.sleep(0.5)
    stop.set()
    for process in workers:
        process.join(30)
        if process.is_alive():
            process.kill()
    commits_after = peer_figures.commits(args.dsn)

    figures = peer_figures.figures(
        peer="dbos",
        submitted=submitted,
        called=peer_figures.provider_calls(args.provider),
        finished=succeeded_at(args.dsn),
        started=started,
        ended=ended,
        warmup=args.warmup,
        enqueue_ms=enqueue_ms,
    )
    figures["commits_per_task"] = (commits_after - commits_before) / max(figures["done"], 1)
    figures["settings"] = (
        f"DBOS Transact 3.4.0; {args.workers} worker process(es) (one per core) beside the enqueuing one; "
        f"queue polled every {args.poll_ms} ms, {args.concurrency} workflows at once per worker; "
        f"{args.clients} enqueuing clients, {args.window} tasks in flight"
    )
    figures.update({"clients": args.clients, "window": args.window, "seconds": args.seconds, "workers": args.workers})
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
