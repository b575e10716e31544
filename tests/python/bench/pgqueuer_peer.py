"""The benchmark's peer: pgqueuer on the same Postgres doing the same no-op work.

Concurrent clients enqueue one job per commit (each its own connection, autocommit),
holding at most --window jobs between enqueue and done, as Fenceline's benchmark
holds tasks between submit and `succeeded` (docs/performance.md); one worker process
drains them with a no-op entrypoint. Prints one JSON object: jobs done, the sustained
rate over the measured window, enqueue and end-to-end latency percentiles, and the
database's commits per job.

    python pgqueuer_peer.py --dsn postgresql://... --seconds 60 --clients 16 --window 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import struct
import sys
import time


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def commits(dsn: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        )
    finally:
        await conn.close()


def worker(dsn: str, done, stop, ready, out) -> None:
    """Drains the queue until `stop`; sends back (enqueued_at, done_at) per job."""

    async def run() -> None:
        import asyncpg
        from pgqueuer import PgQueuer
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.models import Job

        conn = await asyncpg.connect(dsn)
        pgq = PgQueuer(AsyncpgDriver(conn))
        seen: list[tuple[float, float]] = []

        @pgq.entrypoint("noop")
        async def noop(job: Job) -> None:
            (enqueued_at,) = struct.unpack("d", job.payload or b"\0" * 8)
            seen.append((enqueued_at, time.time()))
            with done.get_lock():
                done.value += 1

        async def stopper() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            pgq.shutdown.set()

        ready.set()
        watcher = asyncio.create_task(stopper())
        await pgq.run(batch_size=10)
        watcher.cancel()
        out.put(seen)
        await conn.close()

    asyncio.run(run())


async def produce(dsn: str, seconds: float, clients: int, window: int, done) -> tuple[list[float], float, float]:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conns = [await asyncpg.connect(dsn) for _ in range(clients)]
    queries = [Queries(AsyncpgDriver(c)) for c in conns]
    enqueue_ms: list[float] = []
    sent = 0
    started = time.time()
    deadline = started + seconds

    async def client(q: Queries) -> None:
        nonlocal sent
        while time.time() < deadline:
            while sent - done.value >= window:
                await asyncio.sleep(0.001)
            sent += 1
            at = time.time()
            await q.enqueue("noop", struct.pack("d", at))
            enqueue_ms.append((time.time() - at) * 1e3)

    await asyncio.gather(*(client(q) for q in queries))
    for c in conns:
        await c.close()
    return enqueue_ms, started, deadline


async def install(dsn: str) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(conn))
        if not await queries.schema_is_installed():
            await queries.install()
    finally:
        await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--window", type=int, default=400)
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds left out of the sustained rate")
    args = parser.parse_args()

    asyncio.run(install(args.dsn))
    context = multiprocessing.get_context("spawn")
    done, stop, ready, out = context.Value("q", 0), context.Event(), context.Event(), context.Queue()
    drain = context.Process(target=worker, args=(args.dsn, done, stop, ready, out))
    drain.start()
    ready.wait(30)
    time.sleep(0.5)
    commits_before = asyncio.run(commits(args.dsn))
    enqueue_ms, started, ended = asyncio.run(produce(args.dsn, args.seconds, args.clients, args.window, done))
    # Let the worker finish what was enqueued (bounded), then stop it.
    sent = len(enqueue_ms)
    limit = time.time() + 30
    while done.value < sent and time.time() < limit:
        time.sleep(0.05)
    stop.set()
    seen = out.get(timeout=60)
    drain.join(30)
    # Closed connections have flushed their counters.
    commits_after = asyncio.run(commits(args.dsn))

    window_from = started + min(args.warmup, args.seconds / 4)
    in_window = [d for (_, d) in seen if window_from <= d <= ended]
    end_to_end = [(d - e) * 1e3 for (e, d) in seen]
    print(
        json.dumps(
            {
                "peer": "pgqueuer",
                "clients": args.clients,
                "window": args.window,
                "seconds": args.seconds,
                "enqueued": sent,
                "done": len(seen),
                "sustained_per_s": len(in_window) / max(ended - window_from, 1e-9),
                "commits_per_job": (commits_after - commits_before) / max(len(seen), 1),
                "enqueue_ms": {q: percentile(enqueue_ms, p) for q, p in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))},
                "end_to_end_ms": {
                    q: percentile(end_to_end, p) for q, p in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))
                },
                "worker_pid": drain.pid,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
