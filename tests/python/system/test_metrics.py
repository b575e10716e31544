"""Scrapes GET /metrics of every service of a running Fenceline system and reads
each page with the Prometheus text parser of `prometheus-client`, as a Prometheus
server would: the families documented in docs/operations.md are there, each
service exports its own and no other's, the counters moved with the tasks that
ran, no page names a tenant or a task, and every metric the alerting rules and
the dashboard of deploy/observability name is one the services export.

Run by tests/tests/observability.rs against a system it started; the environment
says where the services listen and what ran."""

import json
import os
import pathlib
import re
import urllib.error
import urllib.request

import pytest
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families

SERVICES = json.loads(os.environ["FENCELINE_METRICS_SERVICES"])
TASKS = int(os.environ["FENCELINE_METRICS_TASKS"])
MUST_NOT_SHOW = json.loads(os.environ["FENCELINE_METRICS_MUST_NOT_SHOW"])

OBSERVABILITY = pathlib.Path(__file__).resolve().parents[3] / "deploy" / "observability"

# The families every service exports, by type (docs/operations.md, "Every service").
EVERY_SERVICE = {
    "fenceline_build_info": "gauge",
    "fenceline_http_request_duration_seconds": "histogram",
    "fenceline_consumer_lag_records": "gauge",
    "fenceline_consumer_applied_events": "counter",
    "fenceline_consumer_dead_lettered_records": "counter",
    "fenceline_consumer_fenced_batches": "counter",
    "fenceline_consumer_assigned_partitions": "gauge",
    "fenceline_consumer_halted_partitions": "gauge",
    "fenceline_outbox_backlog_rows": "gauge",
    "fenceline_outbox_oldest_age_seconds": "gauge",
    "fenceline_outbox_published_rows": "counter",
    "fenceline_outbox_failed_deliveries": "counter",
    "fenceline_outbox_refused_rows": "counter",
    "process_cpu_seconds": "counter",
    "process_start_time_seconds": "gauge",
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_threads": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
}

PROVIDER_CALLS = {
    "fenceline_provider_calls": "counter",
    "fenceline_provider_call_duration_seconds": "histogram",
}

# Each service's own families, besides those every service exports.
OWN = {
    "intake": {},
    "scheduler": {
        "fenceline_scheduler_grants": "counter",
        "fenceline_policy_resends": "counter",
        "fenceline_scheduler_timer_lateness_seconds": "histogram",
        "fenceline_scheduler_tasks": "gauge",
        "fenceline_task_duration_seconds": "histogram",
    },
    "executor": {
        "fenceline_executor_attempts": "counter",
        "fenceline_executor_leases_taken_over": "counter",
        "fenceline_provider_charges": "counter",
        "fenceline_provider_spend": "counter",
        **PROVIDER_CALLS,
    },
    "reconciler": {
        "fenceline_reconciler_open_cases": "gauge",
        "fenceline_audit_findings": "gauge",
        **PROVIDER_CALLS,
    },
}

# A family shows on a page once it holds a series: these hold none until their
# first event. A run without a standing decision never resends, a catalogue
# without prices never spends, and the reconciler calls a provider only to look a
# call up or to audit.
UNTIL_FIRST_EVENT = {
    "intake": set(),
    "scheduler": {"fenceline_policy_resends"},
    "executor": {"fenceline_provider_spend"},
    "reconciler": set(PROVIDER_CALLS),
}

# The sample names a family of each type exports.
SUFFIXES = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"]}


def scrape(service):
    with urllib.request.urlopen(SERVICES[service] + "/metrics", timeout=10) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return text, {family.name: family for family in text_string_to_metric_families(text)}


def total(family, sample_name, **labels):
    return sum(
        s.value
        for s in family.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_service_serves_the_shared_families_and_no_tenant_data(service):
    text, families = scrape(service)
    lag = [s for s in families["fenceline_consumer_lag_records"].samples]
    assert lag, f"{service} reports the lag of the partitions it holds"
    assert all(s.value >= 0 and {"group", "topic", "partition"} <= s.labels.keys() for s in lag)
    assert total(families["fenceline_consumer_applied_events"], "fenceline_consumer_applied_events_total") > 0
    assert families["fenceline_outbox_backlog_rows"].samples[0].value >= 0
    assert families["fenceline_outbox_oldest_age_seconds"].samples[0].value >= 0
    if service != "reconciler":  # it publishes only when it decides something
        assert total(families["fenceline_outbox_published_rows"], "fenceline_outbox_published_rows_total") > 0
    for word in MUST_NOT_SHOW:
        assert word not in text, f"{service}'s metrics name {word!r}"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_each_service_exports_its_own_families_and_no_other(service):
    _, families = scrape(service)
    exported = {name: family.type for name, family in families.items()}
    expected = {**EVERY_SERVICE, **OWN[service]}
    for name in UNTIL_FIRST_EVENT[service] - exported.keys():
        expected.pop(name, None)
    assert exported == expected, f"{service}'s families and their types"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_service_says_what_it_is_and_how_the_process_fares(service):
    _, families = scrape(service)
    (build,) = families["fenceline_build_info"].samples
    assert build.labels["service"] == service and build.labels["version"] and build.value == 1, build
    assert total(families["process_cpu_seconds"], "process_cpu_seconds_total") > 0
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    assert families["process_threads"].samples[0].value >= 1
    open_fds = families["process_open_fds"].samples[0].value
    assert 0 < open_fds <= families["process_max_fds"].samples[0].value
    assert families["process_start_time_seconds"].samples[0].value > 1_500_000_000


def test_the_scheduler_counts_its_grants_and_times_its_timers():
    _, families = scrape("scheduler")
    assert families["fenceline_scheduler_grants"].type == "counter"
    assert total(families["fenceline_scheduler_grants"], "fenceline_scheduler_grants_total") >= TASKS
    lateness = families["fenceline_scheduler_timer_lateness_seconds"]
    assert lateness.type == "histogram"
    assert total(lateness, "fenceline_scheduler_timer_lateness_seconds_count") >= TASKS


def test_the_scheduler_times_tasks_to_their_final_state_and_counts_the_unfinished_by_state():
    _, families = scrape("scheduler")
    durations = families["fenceline_task_duration_seconds"]
    ended = total(durations, "fenceline_task_duration_seconds_count", kind="image.generate", state="succeeded")
    assert ended == TASKS, f"each task timed once: {ended}"
    assert total(durations, "fenceline_task_duration_seconds_sum", kind="image.generate") > 0
    states = {s.labels["state"]: s.value for s in families["fenceline_scheduler_tasks"].samples}
    unfinished = {"queued", "waiting", "running", "awaiting_approval", "outcome_unknown", "needs_human"}
    assert states == dict.fromkeys(unfinished, 0), states


def test_the_executor_counts_attempts_calls_charges_and_takeovers():
    _, families = scrape("executor")
    attempts = families["fenceline_executor_attempts"]
    assert total(attempts, "fenceline_executor_attempts_total", outcome="succeeded") >= TASKS
    calls = families["fenceline_provider_calls"]
    assert total(calls, "fenceline_provider_calls_total", request="start", outcome="done") >= TASKS
    charges = families["fenceline_provider_charges"]
    assert total(charges, "fenceline_provider_charges_total") >= TASKS
    latency = families["fenceline_provider_call_duration_seconds"]
    timed = total(latency, "fenceline_provider_call_duration_seconds_count", request="start", **{"class": "done"})
    assert timed == total(calls, "fenceline_provider_calls_total", request="start", outcome="done")
    assert "fenceline_executor_leases_taken_over" in families


def test_the_reconciler_reads_open_cases_and_findings_from_its_tables():
    _, families = scrape("reconciler")
    states = {s.labels["state"]: s.value for s in families["fenceline_reconciler_open_cases"].samples}
    assert states == {"outcome_unknown": 0, "needs_human": 0}, states
    findings = {s.labels["finding"] for s in families["fenceline_audit_findings"].samples}
    assert findings == {"no_live_expectation", "no_progress"}


def test_intake_times_its_api_by_route_and_status():
    _, families = scrape("intake")
    durations = families["fenceline_http_request_duration_seconds"]
    submitted = total(
        durations,
        "fenceline_http_request_duration_seconds_count",
        method="POST",
        route="/v1/tasks",
        status="202",
    )
    assert submitted >= TASKS


def test_metrics_need_no_token_where_the_audit_does():
    text, _ = scrape("reconciler")
    assert text.endswith("# EOF\n")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(SERVICES["reconciler"] + "/v1/audit", timeout=10)
    assert refused.value.code == 401


def named_metrics():
    """Every metric name the alerting rules and the dashboard's queries name."""
    exprs = []
    for group in yaml.safe_load((OBSERVABILITY / "alerts.yml").read_text())["groups"]:
        exprs.extend(rule["expr"] for rule in group["rules"])
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        exprs.extend(target["expr"] for target in panel.get("targets", []))
    # Label values are quoted; what is left that looks like ours is a metric name.
    unquoted = [re.sub(r'"[^"]*"', '""', expr) for expr in exprs]
    return {name for expr in unquoted for name in re.findall(r"\b(?:fenceline|process)_[a-z0-9_]+", expr)}


def test_every_metric_the_alerts_and_the_dashboard_name_is_exported():
    # The families of the tables above, which the test before this one holds to
    # what each service's page shows (the few that wait for their first event aside).
    exported = set()
    for service in SERVICES:
        for name, kind in {**EVERY_SERVICE, **OWN[service]}.items():
            exported.update(name + suffix for suffix in SUFFIXES[kind])
    named = named_metrics()
    assert len(named) > 20, named
    assert named <= exported, f"named but exported by no service: {sorted(named - exported)}"
