"""Medians of a `deploy/local/stack bench against REV` run: the rounds of the
baseline build and of the current one, side by side, with the current one's ratio
to the baseline. Reads `<out>/{baseline,current}-<round>/bench.json`, each one run
of the `throughput` scenario; prints a table and writes `<out>/comparison.json`.

Standard library only: it runs with the machine's python3."""

import json
import statistics
import sys
from pathlib import Path

KINDS = ("image.generate", "ticket.reply")


def runs_of(out: Path, build: str, kind: str) -> list[dict]:
    runs = []
    for path in sorted(out.glob(f"{build}-*/bench.json")):
        figures = json.loads(path.read_text()).get("throughput", {}).get(kind, {})
        runs.extend(figures.get("runs", []))
    return runs


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def summary(runs: list[dict]) -> dict:
    """The medians over `runs` of the figures worth comparing."""
    if not runs:
        return {}

    def total(run: dict, field: str, part: str | None = None) -> float | None:
        values = run.get(field)
        if not isinstance(values, dict):
            return None
        parts = [(v.get(part) if part else v) for v in values.values()]
        # A build from before a figure was counted has no such figure.
        if any(p is None for p in parts):
            return None
        return sum(parts)

    out = {
        "throughput_per_s": median([r["throughput_per_s"] for r in runs]),
        "runs_throughput_per_s": [r["throughput_per_s"] for r in runs],
        "cpu_ms_per_task_all_processes": median([total(r, "processes", "cpu_ms_per_task") for r in runs]),
        "postgres_cpu_ms_per_task": median([r["processes"].get("postgres", {}).get("cpu_ms_per_task") for r in runs]),
        "broker_cpu_ms_per_task": median([r["processes"].get("broker", {}).get("cpu_ms_per_task") for r in runs]),
        "postgres_commits_per_task": median([r.get("postgres_commits_per_task") for r in runs]),
        "row_writes_per_task": median([total(r, "row_writes_per_task") for r in runs]),
        "statements_per_task": median([total(r, "statements_per_task", "calls") for r in runs]),
        "kafka_records_per_task": median([r.get("kafka_records_per_task") for r in runs]),
        "postgres_round_trips_per_task": median([total(r, "postgres_round_trips_per_task") for r in runs]),
        "round_trips_without_statement_per_task": median(
            [total(r, "postgres_round_trips_without_statement_per_task") for r in runs]
        ),
        "kafka_records_delivered_per_task": median([r.get("kafka_records_delivered_per_task") for r in runs]),
        "ctx_switches_per_task_all_processes": median(
            [total(r, "processes", "voluntary_ctx_switches_per_task") for r in runs]
        ),
        "threads_all_processes": median([total(r, "processes", "peak_threads") for r in runs]),
    }
    # Each process's context switches and threads: a change shows where it moved them.
    for name in sorted({name for r in runs for name in r.get("processes", {})}):
        for field, label in (("voluntary_ctx_switches_per_task", "ctx_switches_per_task"), ("peak_threads", "threads")):
            out[f"{label} {name}"] = median([r["processes"].get(name, {}).get(field) for r in runs])
    for latency in ("submit_answered", "submit_to_provider_call", "submit_to_succeeded"):
        out[f"{latency}_p99_ms"] = median([r["latency_ms"][latency]["p99"] for r in runs])
    return out


def main() -> None:
    out = Path(sys.argv[1])
    comparison = {}
    for kind in KINDS:
        baseline, current = summary(runs_of(out, "baseline", kind)), summary(runs_of(out, "current", kind))
        if not baseline or not current:
            continue
        comparison[kind] = {"baseline": baseline, "current": current}
        print(f"\n{kind}: medians of {len(baseline['runs_throughput_per_s'])} runs each")
        print(f"  {'figure':<44} {'baseline':>10} {'current':>10} {'ratio':>7}")
        # Figures only one build counts (a baseline from before they were counted)
        # are shown without a ratio.
        for figure in list(baseline) + [f for f in current if f not in baseline]:
            was, now = baseline.get(figure), current.get(figure)
            if figure.startswith("runs_"):
                print(f"  {figure:<44} {str(was):>10} {str(now):>10}")
                continue
            ratio = f"{now / was:.3f}" if was and now is not None else ""
            print(f"  {figure:<44} {str(was):>10} {str(now):>10} {ratio:>7}")
    (out / "comparison.json").write_text(json.dumps(comparison, indent=1))


if __name__ == "__main__":
    main()
