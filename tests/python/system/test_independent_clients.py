"""Fenceline as another team's code sees it: an upstream system produces TaskRequest
records with confluent-kafka, encoded with fastavro from the .avsc files in schemas/
(none of Fenceline's own code), and a dashboard follows a task on fenceline.status.

The Rust suite `tests/tests/kafka.rs` starts a whole system and runs this file with
the system's addresses in the environment; it is not collected by the plain Python run.
It also configures the sources used here (`SOURCES`) for the tenant, as an operator
does with `fenceline-intake add-upstream-source`: records from any other source are
refused.
"""

import io
import json
import os
import pathlib
import secrets
import struct
import time
import urllib.request
import uuid

import fastavro
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType
from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

ROOT = pathlib.Path(__file__).resolve().parents[3]
SCHEMAS = ROOT / "schemas"
MARKER = b"\xc3\x01"

BROKERS = os.environ["FENCELINE_CLIENTS_BROKERS"]
PREFIX = os.environ["FENCELINE_CLIENTS_TOPIC_PREFIX"]
INTAKE = os.environ["FENCELINE_CLIENTS_INTAKE_URL"]
TOKEN = os.environ["FENCELINE_CLIENTS_TOKEN"]
TENANT = os.environ["FENCELINE_CLIENTS_TENANT"]
KIND = os.environ["FENCELINE_CLIENTS_KIND"]
# Configured for TENANT by tests/tests/kafka.rs; keep the two lists alike.
SOURCES = ("python-upstream", "python-dashboard")


def schema(event_type):
    return parse_schema(json.loads((SCHEMAS / f"{event_type}.avsc").read_text()))


def fingerprint_of(parsed):
    """The 64-bit Rabin fingerprint of the parsing canonical form, little-endian."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


def encode(event_type, record):
    """Avro single-object encoding: marker, fingerprint, body."""
    parsed = schema(event_type)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, parsed, record)
    return MARKER + fingerprint_of(parsed) + body.getvalue(), fingerprint_of(parsed).hex()


def decode(event_type, value):
    parsed = schema(event_type)
    assert value[:2] == MARKER, "single-object marker"
    if value[2:10] != fingerprint_of(parsed):
        return None  # another event type on the topic
    return fastavro.schemaless_reader(io.BytesIO(value[10:]), parsed)


def uuid7():
    """A UUIDv7 (the event_id header's form): 48 bits of milliseconds, then random."""
    millis = time.time_ns() // 1_000_000
    raw = bytearray(millis.to_bytes(6, "big") + secrets.token_bytes(10))
    raw[6] = (raw[6] & 0x0F) | 0x70
    raw[8] = (raw[8] & 0x3F) | 0x80
    return str(uuid.UUID(bytes=bytes(raw)))


def headers(event_type, schema_fingerprint):
    """The headers docs/wire.md documents for every record."""
    trace, span = secrets.token_hex(16), secrets.token_hex(8)
    return [
        ("event_id", uuid7().encode()),
        ("event_type", event_type.encode()),
        ("schema_fingerprint", schema_fingerprint.encode()),
        ("producer", b"python-upstream"),
        ("produced_at", str(time.time_ns() // 1_000).encode()),
        ("traceparent", f"00-{trace}-{span}-01".encode()),
    ]


def api(path):
    request = urllib.request.Request(f"{INTAKE}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def wait_for(what, probe, seconds=90):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {seconds} s")


def test_an_outside_producer_submits_tasks_through_the_upstream_topic():
    run = uuid.uuid4().hex[:12]
    producer = Producer({"bootstrap.servers": BROKERS, "enable.idempotence": True, "acks": "all"})
    delivered = []
    for n in range(5):
        request = {
            "source": SOURCES[0],
            "source_event_id": f"{run}-{n}",
            "tenant": TENANT,
            "kind": KIND,
            "input_json": json.dumps({"prompt": f"shoe {n}"}),
            "priority": "normal",
            "deadline": None,
            "not_before": None,
            "labels": {"run": run},
        }
        value, fp = encode("TaskRequest", request)
        for _ in range(2 if n == 0 else 1):  # the first one is delivered twice
            producer.produce(
                f"{PREFIX}fenceline.intake.requests",
                key=f"{run}-{n}".encode(),
                value=value,
                headers=headers("TaskRequest", fp),
                on_delivery=lambda err, msg: delivered.append(err),
            )
    assert producer.flush(30) == 0, "every record delivered"
    assert delivered and all(err is None for err in delivered), delivered

    listed = wait_for(
        "the five requests listed by the API",
        lambda: (lambda tasks: tasks if len(tasks) == 5 else None)(api(f"/v1/tasks?label=run:{run}")["tasks"]),
    )
    assert {t["kind"] for t in listed} == {KIND}
    assert len({t["task_id"] for t in listed}) == 5, "the re-sent record made no second task"


def test_a_dashboard_follows_a_task_to_succeeded_on_the_status_topic():
    status_topic = f"{PREFIX}fenceline.status"
    admin = AdminClient({"bootstrap.servers": BROKERS})
    described = admin.describe_configs([ConfigResource(ResourceType.TOPIC, status_topic)])
    config = next(iter(described.values())).result(timeout=30)
    assert config["cleanup.policy"].value == "compact", "the status topic keeps the latest snapshot per task"

    run = uuid.uuid4().hex[:12]
    producer = Producer({"bootstrap.servers": BROKERS, "enable.idempotence": True})
    value, fp = encode(
        "TaskRequest",
        {
            "source": SOURCES[1],
            "source_event_id": run,
            "tenant": TENANT,
            "kind": KIND,
            "input_json": json.dumps({"prompt": "a red shoe"}),
            "priority": "high",
            "deadline": None,
            "not_before": None,
            "labels": {"run": run},
        },
    )
    producer.produce(f"{PREFIX}fenceline.intake.requests", key=run.encode(), value=value, headers=headers("TaskRequest", fp))
    assert producer.flush(30) == 0
    task_id = wait_for("the task listed", lambda: api(f"/v1/tasks?label=run:{run}")["tasks"])[0]["task_id"]

    consumer = Consumer(
        {
            "bootstrap.servers": BROKERS,
            "group.id": f"python-dashboard-{run}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    metadata = consumer.list_topics(status_topic, timeout=30)
    partitions = metadata.topics[status_topic].partitions
    consumer.assign([TopicPartition(status_topic, p, 0) for p in partitions])
    seen, deadline = [], time.monotonic() + 120
    try:
        while time.monotonic() < deadline and (not seen or seen[-1]["state"] != "succeeded"):
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            if message.value() is None:
                # A tombstone: the task was purged after its retention (docs/wire.md).
                continue
            event_type = dict(message.headers() or []).get("event_type", b"").decode()
            assert event_type == "TaskStatus", f"only status snapshots on {status_topic}"
            status = decode("TaskStatus", message.value())
            if status and status["task_id"] == task_id:
                assert message.key().decode() == task_id, "keyed by task"
                seen.append(status)
    finally:
        consumer.close()
    states = [s["state"] for s in seen]
    assert states and states[-1] == "succeeded", f"states seen for {task_id}: {states}"
    versions = [s["version"] for s in seen]
    assert versions == sorted(versions), "snapshots in version order"
    result = seen[-1]["result"]
    assert result and len(result["sha256"]) == 64 and result["size_bytes"] > 0, result
