"""Scrapes GET /metrics of every service of a running Fenceline system and reads
each page with the Prometheus text parser of `prometheus-client`, as a Prometheus
server would: the families documented in docs/operations.md are there, the
counters moved with the tasks that ran, and no page names a tenant or a task.

Run by tests/tests/observability.rs against a system it started; the environment
says where the services listen and what ran."""

import json
import os
import urllib.error
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

SERVICES = json.loads(os.environ["FENCELINE_METRICS_SERVICES"])
TASKS = int(os.environ["FENCELINE_METRICS_TASKS"])
MUST_NOT_SHOW = json.loads(os.environ["FENCELINE_METRICS_MUST_NOT_SHOW"])

EVERY_SERVICE = [
    "fenceline_http_request_duration_seconds",
    "fenceline_outbox_backlog_rows",
    "fenceline_outbox_oldest_age_seconds",
    "fenceline_outbox_published_rows",
    "fenceline_consumer_lag_records",
    "fenceline_consumer_applied_events",
    "fenceline_consumer_assigned_partitions",
]


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
    for name in EVERY_SERVICE:
        assert name in families, f"{service} lacks {name}"
    assert families["fenceline_consumer_lag_records"].type == "gauge"
    lag = [s for s in families["fenceline_consumer_lag_records"].samples]
    assert lag, f"{service} reports the lag of the partitions it holds"
    assert all(s.value >= 0 and {"group", "topic", "partition"} <= s.labels.keys() for s in lag)
    assert total(families["fenceline_consumer_applied_events"], "fenceline_consumer_applied_events") > 0
    assert families["fenceline_outbox_backlog_rows"].samples[0].value >= 0
    assert families["fenceline_outbox_oldest_age_seconds"].samples[0].value >= 0
    if service != "reconciler":  # it publishes only when it decides something
        assert total(families["fenceline_outbox_published_rows"], "fenceline_outbox_published_rows") > 0
    for word in MUST_NOT_SHOW:
        assert word not in text, f"{service}'s metrics name {word!r}"


def test_the_scheduler_counts_its_grants_and_times_its_timers():
    _, families = scrape("scheduler")
    assert families["fenceline_scheduler_grants"].type == "counter"
    assert total(families["fenceline_scheduler_grants"], "fenceline_scheduler_grants_total") >= TASKS
    lateness = families["fenceline_scheduler_timer_lateness_seconds"]
    assert lateness.type == "histogram"
    assert total(lateness, "fenceline_scheduler_timer_lateness_seconds_count") >= TASKS


def test_the_executor_counts_attempts_calls_charges_and_takeovers():
    _, families = scrape("executor")
    attempts = families["fenceline_executor_attempts"]
    assert total(attempts, "fenceline_executor_attempts_total", outcome="succeeded") >= TASKS
    calls = families["fenceline_provider_calls"]
    assert total(calls, "fenceline_provider_calls_total", request="start", outcome="done") >= TASKS
    charges = families["fenceline_provider_charges"]
    assert total(charges, "fenceline_provider_charges_total") >= TASKS
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
