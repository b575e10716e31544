"""Reads Fenceline's golden records with fastavro, an Avro implementation independent
of the Rust one, as a dashboard in another language would read the status topic."""

import io
import json
import pathlib
import struct

import fastavro
import pytest
from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"
GOLDEN = ROOT / "shared" / "events" / "tests" / "golden"
MARKER = b"\xc3\x01"


def event_types():
    return sorted(p.stem for p in SCHEMAS.glob("*.avsc"))


def normalise(value):
    """fastavro's logical types back to the wire's plain values."""
    import datetime

    if isinstance(value, datetime.datetime):
        delta = value - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if isinstance(value, bytes):
        return list(value)
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


def test_every_schema_has_a_golden_record():
    assert event_types(), "no schemas found"
    missing = [t for t in event_types() if not (GOLDEN / f"{t}.bin").exists()]
    assert not missing


@pytest.mark.parametrize("event_type", event_types())
def test_golden_record_decodes_with_fastavro(event_type):
    schema = parse_schema(json.loads((SCHEMAS / f"{event_type}.avsc").read_text()))
    data = (GOLDEN / f"{event_type}.bin").read_bytes()

    assert data[:2] == MARKER, "single-object marker"
    # The fingerprint is the 64-bit Rabin (CRC-64-AVRO) of the parsing canonical
    # form, little-endian.
    expected = fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO")
    assert data[2:10].hex() == expected

    record = fastavro.schemaless_reader(io.BytesIO(data[10:]), schema)
    wanted = json.loads((GOLDEN / f"{event_type}.json").read_text())
    assert normalise(record) == wanted


def test_the_status_record_reads_as_a_dashboard_would():
    schema = parse_schema(json.loads((SCHEMAS / "TaskStatus.avsc").read_text()))
    data = (GOLDEN / "TaskStatus.bin").read_bytes()
    record = fastavro.schemaless_reader(io.BytesIO(data[10:]), schema)
    assert record["state"] == "succeeded"
    assert record["result"]["sha256"] == "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    assert struct.unpack("<q", data[2:10])[0] != 0
