"""What the durable peers of the benchmark (dbos_peer.py, temporal_peer.py) share.

Their job is Fenceline's one-step task: one `POST /v1/operations` to the benchmark's
fake provider with an `Idempotency-Key` per task. The instants they report are those
Fenceline's benchmark reports: submitted (when the client began to submit), the
provider's call (`received_at_us` in the fake provider's call log, by key), and the
final state (as the engine recorded it). Standard library only.
"""

from __future__ import annotations

import json
import time
import urllib.request


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))], 2)


def percentiles(values: list[float]) -> dict:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "p99_9": percentile(values, 0.999),
            "n": len(values)}


def wait_ready(provider: str, seconds: float = 30.0) -> None:
    """Waits until the fake provider answers its readiness probe."""
    limit = time.time() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"{provider}/readyz", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if time.time() > limit:
            raise SystemExit(f"the fake provider at {provider} is not ready")
        time.sleep(0.1)


def provider_calls(provider: str) -> dict[str, float]:
    """The first call the provider received under each key, in seconds since the epoch."""
    with urllib.request.urlopen(f"{provider}/admin/calls", timeout=60) as answer:
        calls = json.load(answer)
    first: dict[str, float] = {}
    for call in calls:
        key = call.get("operation_key")
        if key is not None:
            first[key] = min(first.get(key, float("inf")), call["received_at_us"] / 1e6)
    return first


def commits(dsn: str) -> int:
    """Transactions committed in the database `dsn` names so far."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(
            conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]
        )


def figures(
    *,
    peer: str,
    submitted: dict[str, float],
    called: dict[str, float],
    finished: dict[str, float],
    started: float,
    ended: float,
    warmup: float,
    enqueue_ms: list[float],
) -> dict:
    """Throughput after the warm-up and latency from submission to the provider's call
    and to the final state.

    The measured window runs from the end of the warm-up to the last submission or,
    for an engine still working through what it accepted then, to the last task's
    final state: an engine that accepts work faster than it finishes it is measured
    by what it finishes."""
    window_from = started + min(warmup, (ended - started) / 4)
    to_call = [(called[k] - at) * 1e3 for k, at in submitted.items() if k in called]
    to_final = [(finished[k] - at) * 1e3 for k, at in submitted.items() if k in finished]
    window_to = max([ended] + [finished[k] for k in submitted if k in finished])
    in_window = sum(1 for k in submitted if k in finished and window_from <= finished[k])
    return {
        "peer": peer,
        "enqueued": len(submitted),
        "done": sum(1 for k in submitted if k in finished),
        "unfinished": sum(1 for k in submitted if k not in finished),
        "provider_calls": sum(1 for k in submitted if k in called),
        "sustained_per_s": round(in_window / max(window_to - window_from, 1e-9), 1),
        "window_s": round(window_to - window_from, 1),
        "enqueue_ms": percentiles(enqueue_ms),
        "latency_ms": {"submit_to_provider_call": percentiles(to_call), "submit_to_final_state": percentiles(to_final)},
    }
