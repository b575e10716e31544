//! The wire contract: golden bytes of one record of every event type, round trips,
//! and schema evolution. `FENCELINE_BLESS=1` rewrites the golden files; do that
//! only for a new event type, never to make a changed encoding pass.

use std::collections::BTreeMap;
use std::path::PathBuf;

use apache_avro::schema_compatibility::SchemaCompatibility;
use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::vocabulary::*;
use fenceline_events::*;
use uuid::Uuid;

fn task() -> TaskId {
    TaskId::from_uuid(Uuid::from_u128(0x0190_f6c8_0000_7000_8000_0000_0000_0001))
}
fn grant() -> GrantId {
    GrantId::from_uuid(Uuid::from_u128(0x0190_f6c8_0000_7000_8000_0000_0000_0002))
}
fn at(seconds: i64) -> Timestamp {
    Timestamp(1_767_225_600_000_000 + seconds * 1_000_000)
}
fn artifact() -> ArtifactRef {
    ArtifactRef {
        uri: "s3://fenceline-artifacts/0190f6c8/image.png".into(),
        sha256: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".into(),
        size_bytes: 48_213,
    }
}
/// One entry only: Avro maps have no defined order, so several entries would make
/// the golden bytes depend on hashing.
fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([("campaign".into(), "spring".into())])
}

/// One fixed record of every event type. Do not change: the golden files pin them.
fn samples() -> Vec<Event> {
    vec![
        TaskRequest {
            source: "helpdesk".into(),
            source_event_id: "ticket-81723".into(),
            tenant: "acme".into(),
            kind: "ticket.triage".into(),
            input_json: r#"{"ticket":81723}"#.into(),
            priority: Priority::Normal,
            deadline: Some(at(3600)),
            not_before: None,
            labels: labels(),
        }
        .into(),
        RequestRejected {
            source: Some("helpdesk".into()),
            source_event_id: None,
            tenant: Some("acme".into()),
            problem_type: "invalid-record".into(),
            reason: "value is not Avro single-object encoded".into(),
            original: Bytes(vec![0, 1, 2, 0xff]),
            rejected_at: at(1),
        }
        .into(),
        TaskAccepted {
            task_id: task(),
            tenant: "acme".into(),
            kind: "image.generate".into(),
            input_json: r#"{"prompt":"a red shoe"}"#.into(),
            priority: Priority::High,
            deadline: Some(at(600)),
            not_before: Some(at(5)),
            labels: labels(),
            source: "api".into(),
            accepted_at: at(0),
        }
        .into(),
        CancelRequested {
            task_id: task(),
            tenant: "acme".into(),
            requested_by: "token:ops".into(),
            requested_at: at(9),
        }
        .into(),
        SignalReceived {
            task_id: task(),
            tenant: "acme".into(),
            signal_name: "approve".into(),
            signal_id: "approval-7".into(),
            payload_json: r#"{"approved":true}"#.into(),
            received_at: at(10),
            step: Some("approve".into()),
            generation: Some(1),
            decision: Some(ApprovalDecision::Reject),
        }
        .into(),
        ResolutionDecided {
            task_id: task(),
            tenant: "acme".into(),
            case_id: "case-1".into(),
            action: ResolutionAction::AttachResult,
            charge_acknowledged: false,
            attached_result: Some(artifact()),
            decided_by: "token:ops".into(),
            decided_at: at(11),
        }
        .into(),
        AttemptGranted {
            grant_id: grant(),
            task_id: task(),
            tenant: "acme".into(),
            attempt: 2,
            generation: 0,
            kind: "image.generate".into(),
            input_json: r#"{"prompt":"a red shoe"}"#.into(),
            resume_after_step: Some("classify".into()),
            provider: "imagegen".into(),
            slot: "imagegen#3".into(),
            lease_budget_ms: 120_000,
            deadline: Some(at(600)),
            granted_at: at(12),
        }
        .into(),
        CancelAttempt { task_id: task(), grant_id: grant(), requested_at: at(13) }.into(),
        AttemptClaimed {
            grant_id: grant(),
            task_id: task(),
            attempt: 2,
            fencing_token: 7,
            lease_expires_at: at(44),
            worker: "executor-1/worker-3".into(),
        }
        .into(),
        CallIntentRecorded {
            task_id: task(),
            attempt: 2,
            step: "render".into(),
            operation_key: "5f2b1c".into(),
            provider: "imagegen".into(),
            recorded_at: at(15),
        }
        .into(),
        ProviderAccepted {
            task_id: task(),
            attempt: 2,
            step: "render".into(),
            operation_key: "5f2b1c".into(),
            provider_request_id: "req-991".into(),
            accepted_at: at(16),
        }
        .into(),
        StepCheckpointed {
            task_id: task(),
            attempt: 2,
            step: "classify".into(),
            output_ref: "pg://executor/checkpoints/17".into(),
            sha256: "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855".into(),
            checkpointed_at: at(17),
            generation: Some(0),
            output_json: Some(r#"{"category":"refund"}"#.into()),
            provider: Some("llm".into()),
            cost_micros: Some(1_004_750),
        }
        .into(),
        AwaitingSignal {
            task_id: task(),
            attempt: 2,
            step: "approve".into(),
            signal_name: "approve".into(),
            since: at(18),
        }
        .into(),
        AttemptSucceeded { task_id: task(), attempt: 2, grant_id: grant(), result: artifact(), finished_at: at(19) }
            .into(),
        AttemptFailed {
            task_id: task(),
            attempt: 2,
            grant_id: grant(),
            error_class: ErrorClass::Throttled,
            message: "429 from imagegen".into(),
            retry_after_ms: Some(30_000),
            money_may_have_been_spent: false,
            failed_at: at(20),
        }
        .into(),
        AttemptReleased {
            task_id: task(),
            attempt: 2,
            grant_id: grant(),
            reason: ReleaseReason::Busy,
            released_at: at(21),
        }
        .into(),
        AttemptLost {
            task_id: task(),
            attempt: 2,
            grant_id: grant(),
            last_phase: Phase::ProviderAccepted,
            last_phase_at: at(16),
            step: Some("render".into()),
            operation_key: Some("5f2b1c".into()),
            provider_request_id: Some("req-991".into()),
            detected_at: at(60),
        }
        .into(),
        FencedResultReported {
            task_id: task(),
            attempt: 2,
            grant_id: grant(),
            fencing_token: 3,
            step: "render".into(),
            operation_key: "5f2b1c".into(),
            provider_request_id: Some("req-991".into()),
            result: artifact(),
            verified_at: at(59),
        }
        .into(),
        RecoveryDecided {
            task_id: task(),
            attempt: 2,
            decision: RecoveryDecision::OutcomeUnknown,
            case_id: Some("case-1".into()),
            result: None,
            evidence: vec![Evidence {
                source: "provider:imagegen".into(),
                observed_at: at(61),
                finding: "look-up unsupported".into(),
            }],
            decided_at: at(62),
        }
        .into(),
        TaskStatus {
            task_id: task(),
            tenant: "acme".into(),
            kind: "image.generate".into(),
            state: TaskState::Succeeded,
            reason: None,
            attempt: 2,
            step: Some("render".into()),
            phase: Some(Phase::Finished),
            next_attempt_at: None,
            result: Some(artifact()),
            case_id: None,
            updated_at: at(63),
            version: 9,
        }
        .into(),
        DeadLetter {
            topic: "fenceline.tasks".into(),
            partition: 1,
            offset: 4711,
            consumer: "scheduler".into(),
            reason: "value is not Avro single-object encoded: missing the C3 01 marker".into(),
            original_key: Some(Bytes(b"k".to_vec())),
            original_value: Some(Bytes(b"garbage".to_vec())),
            original_headers: vec![OriginalHeader { name: "event_id".into(), value: None }],
            dead_lettered_at: at(64),
        }
        .into(),
    ]
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

#[test]
fn every_event_type_has_a_schema_and_a_sample() {
    let mut sampled: Vec<&str> = samples().iter().map(Event::event_type).collect();
    sampled.sort_unstable();
    let mut declared = EVENT_TYPES.to_vec();
    declared.sort_unstable();
    assert_eq!(sampled, declared, "one sample per event type");
    assert_eq!(registry().event_types(), declared, "one schema file per event type");
}

// Do not change: the golden files are the wire contract. A diff here means records
// already on a topic would be read differently.
#[test]
fn golden_bytes_are_pinned() {
    let bless = std::env::var("FENCELINE_BLESS").is_ok_and(|v| v == "1");
    for event in samples() {
        let (bytes, _) = encode(&event).expect("encode sample");
        let path = golden_dir().join(format!("{}.bin", event.event_type()));
        // The same record as JSON, for readers in other languages to compare with.
        let json_path = path.with_extension("json");
        let json = serde_json::to_string_pretty(&event).expect("json") + "\n";
        if bless {
            std::fs::write(&path, &bytes).expect("write golden");
            std::fs::write(&json_path, &json).expect("write golden json");
            continue;
        }
        assert_eq!(std::fs::read_to_string(&json_path).expect("read golden json"), json);
        let golden = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        assert_eq!(bytes, golden, "{} encodes differently from its golden file", event.event_type());
        assert_eq!(decode(&golden).expect("decode golden"), event, "{} golden decodes back", event.event_type());
    }
}

#[test]
fn every_sample_round_trips_with_headers() {
    for event in samples() {
        let (bytes, fp) = encode(&event).expect("encode");
        let headers = Headers {
            event_id: fenceline_domain::ids::EventId::new_v7(),
            event_type: event.event_type().into(),
            schema_fingerprint: hex::encode(fp),
            producer: "test".into(),
            produced_at: Timestamp::now(),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
        };
        let pairs = headers.to_pairs();
        let decoded = Envelope::decode(pairs.iter().map(|(k, v)| (*k, Some(v.as_bytes()))), &bytes).expect("decode");
        assert_eq!(decoded, Envelope { headers, event });
    }
}

#[test]
fn damaged_values_are_refused_with_a_reason() {
    let (bytes, _) = encode(&samples()[0]).expect("encode");
    assert!(matches!(decode(b"{\"json\":1}"), Err(DecodeError::NotSingleObject(_))));
    let mut unknown = bytes.clone();
    unknown[2] ^= 0xff;
    assert!(matches!(decode(&unknown), Err(DecodeError::UnknownSchema(_))));
    assert!(matches!(decode(&bytes[..bytes.len() - 3]), Err(DecodeError::Malformed { .. })));
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert!(matches!(decode(&trailing), Err(DecodeError::Malformed { .. })));
}

#[test]
fn headers_and_value_must_agree_on_the_type() {
    let (bytes, fp) = encode(&samples()[0]).expect("encode");
    let headers = Headers {
        event_id: fenceline_domain::ids::EventId::new_v7(),
        event_type: "TaskStatus".into(),
        schema_fingerprint: hex::encode(fp),
        producer: "test".into(),
        produced_at: Timestamp::now(),
        traceparent: None,
    };
    let pairs = headers.to_pairs();
    let err = Envelope::decode(pairs.iter().map(|(k, v)| (*k, Some(v.as_bytes()))), &bytes).expect_err("mismatch");
    assert!(matches!(err, DecodeError::TypeMismatch { .. }), "{err}");
    let missing = Envelope::decode(std::iter::empty(), &bytes).expect_err("no headers");
    assert_eq!(missing.to_string(), "header event_id is missing");
}

/// `event`'s fields as the `schema` of another version sees them: the fields that
/// version has, and nothing else.
fn as_seen_by(schema: &apache_avro::Schema, event: &Event) -> apache_avro::types::Value {
    apache_avro::to_value(event).expect("to value").resolve(schema).expect("resolve against the other version")
}

/// Encodes `event`'s value with an older `writer` schema, as an old producer would.
fn written_by(writer: &apache_avro::Schema, event: &Event) -> Vec<u8> {
    let mut out = vec![0xC3, 0x01];
    out.extend_from_slice(&writer.fingerprint::<apache_avro::rabin::Rabin>().bytes);
    out.extend(apache_avro::to_avro_datum(writer, as_seen_by(writer, event)).expect("old datum"));
    out
}

/// The versions of an event type, oldest first: its history (`v1`, `v2`, … ordered
/// by number, not by name) and then the current schema.
fn versions(event_type: &str) -> Vec<(String, apache_avro::Schema)> {
    let mut history = registry().history(event_type);
    history.sort_by_key(|(label, _)| label.trim_start_matches('v').parse::<u32>().expect("history labels are vN"));
    let (current, _) = registry().current(event_type).expect("current");
    let mut all: Vec<(String, apache_avro::Schema)> = history.into_iter().map(|(l, s)| (l.to_owned(), s)).collect();
    all.push(("current".to_owned(), current.clone()));
    all
}

#[test]
fn every_schema_reads_what_its_previous_versions_wrote() {
    let mut checked = 0;
    for event_type in registry().event_types() {
        let (current, _) = registry().current(event_type).expect("current");
        for (label, old) in registry().history(event_type) {
            let compatibility = SchemaCompatibility::can_read(&old, current);
            assert!(compatibility.is_ok(), "{event_type}: current cannot read {label}: {compatibility:?}");
            checked += 1;
        }
    }
    // An empty or unread schemas/history would make this test prove nothing.
    assert!(checked > 0, "no historical schema was found in schemas/history");
}

/// A rolling upgrade runs two adjacent versions side by side (docs/deploy.md, "Rolling
/// upgrades"): each must read the other's records. For every version kept in
/// schemas/history and the one after it, the newer reader reads bytes the older
/// writer wrote (backward) and the older reader reads bytes the newer writer wrote
/// (forward), keeping every field the older version has.
#[test]
fn adjacent_versions_read_each_others_records_both_ways() {
    let mut pairs = 0;
    for sample in samples() {
        let event_type = sample.event_type();
        for adjacent in versions(event_type).windows(2) {
            let [(old_label, old), (new_label, new)] = adjacent else { unreachable!("windows of two") };
            let context = format!("{event_type} {old_label} and {new_label}");
            assert!(SchemaCompatibility::can_read(old, new).is_ok(), "{context}: the newer cannot read the older");
            assert!(SchemaCompatibility::can_read(new, old).is_ok(), "{context}: the older cannot read the newer");

            // Backward: the older writer's bytes, through the newer reader.
            let old_bytes = written_by(old, &sample);
            let read = apache_avro::from_avro_datum(old, &mut &old_bytes[10..], Some(new))
                .unwrap_or_else(|e| panic!("{context}: the newer reader refuses the older bytes: {e}"));
            assert_eq!(read.resolve(old).expect("back to the older"), as_seen_by(old, &sample), "{context}: backward");

            // Forward: the newer writer's bytes, through the older reader.
            let new_bytes = written_by(new, &sample);
            let read = apache_avro::from_avro_datum(new, &mut &new_bytes[10..], Some(old))
                .unwrap_or_else(|e| panic!("{context}: the older reader refuses the newer bytes: {e}"));
            assert_eq!(read, as_seen_by(old, &sample), "{context}: forward");

            if new_label == "current" {
                // What this build writes is what the previous build's decoder gets.
                let (encoded, _) = encode(&sample).expect("encode");
                assert_eq!(encoded, new_bytes, "{context}: the current encoder writes the current version");
                let decoded = decode(&old_bytes).unwrap_or_else(|e| panic!("{context}: decode: {e}"));
                assert_eq!(
                    as_seen_by(old, &decoded),
                    as_seen_by(old, &sample),
                    "{context}: decode keeps the older fields"
                );
            }
            pairs += 1;
        }
    }
    // Without a kept version nothing here runs: that is a failure, not a pass.
    assert!(pairs > 0, "schemas/history keeps no previous version of any event type");
}

/// Bytes a v1 producer wrote (the golden record of `RequestRejected` before it
/// gained `tenant`), kept byte for byte: they still decode, with the default.
#[test]
fn a_record_written_by_request_rejected_v1_still_decodes() {
    let v1 = std::fs::read(golden_dir().join("history/RequestRejected.v1.bin")).expect("v1 golden");
    let history = registry().history("RequestRejected");
    let labels: Vec<&str> = history.iter().map(|(label, _)| *label).collect();
    assert_eq!(labels, ["v1"]);
    assert_eq!(&v1[2..10], &history[0].1.fingerprint::<apache_avro::rabin::Rabin>().bytes[..], "written with v1");
    let Ok(Event::RequestRejected(read)) = decode(&v1) else { panic!("v1 bytes do not decode") };
    let Some(Event::RequestRejected(sample)) = samples().into_iter().find(|e| e.event_type() == "RequestRejected")
    else {
        panic!("no sample")
    };
    assert_eq!(read, RequestRejected { tenant: None, ..sample });
}

/// The mechanism the history relies on, shown on a synthetic older TaskStatus that
/// lacks an optional field: its records resolve to the current type with the default.
#[test]
fn a_record_from_a_writer_without_a_new_optional_field_reads_with_its_default() {
    let (current, _) = registry().current("TaskStatus").expect("current");
    let mut json: serde_json::Value = serde_json::from_str(&current.canonical_form()).expect("canonical JSON");
    json["fields"].as_array_mut().expect("fields").retain(|f| f["name"] != "case_id");
    let older = apache_avro::Schema::parse_str(&json.to_string()).expect("older schema parses");
    assert!(SchemaCompatibility::can_read(&older, current).is_ok());

    let status = samples().into_iter().find(|e| e.event_type() == "TaskStatus").expect("sample");
    let Event::TaskStatus(mut with_case) = status else { unreachable!("found by type") };
    with_case.case_id = Some("case-9".into());
    let bytes = written_by(&older, &Event::TaskStatus(with_case.clone()));
    let err = decode(&bytes).expect_err("a fingerprint that is not in schemas/history is refused");
    assert!(matches!(err, DecodeError::UnknownSchema(_)));
    let value = apache_avro::from_avro_datum(&older, &mut &bytes[10..], Some(current)).expect("resolve old to current");
    let read: TaskStatus = apache_avro::from_value(&value).expect("current type");
    assert_eq!(read.case_id, None, "the default of the field the old writer lacked");
    assert_eq!(read.task_id, with_case.task_id);
}

/// Bytes the first versions of `StepCheckpointed` (before it carried the step's
/// output, and before it carried the call's provider and cost) and `SignalReceived` (before a signal named its wait and decision)
/// wrote, kept byte for byte: they still decode, the new fields absent.
#[test]
fn records_written_before_outputs_and_decisions_travelled_still_decode() {
    let sample_of = |event_type: &str| samples().into_iter().find(|e| e.event_type() == event_type).expect("sample");
    let v1 = std::fs::read(golden_dir().join("history/StepCheckpointed.v1.bin")).expect("v1 golden");
    let (Ok(Event::StepCheckpointed(read)), Event::StepCheckpointed(sample)) =
        (decode(&v1), sample_of("StepCheckpointed"))
    else {
        panic!("StepCheckpointed v1 bytes do not decode")
    };
    assert_eq!(
        read,
        StepCheckpointed { generation: None, output_json: None, provider: None, cost_micros: None, ..sample.clone() }
    );
    let v2 = std::fs::read(golden_dir().join("history/StepCheckpointed.v2.bin")).expect("v2 golden");
    let Ok(Event::StepCheckpointed(read)) = decode(&v2) else { panic!("StepCheckpointed v2 bytes do not decode") };
    assert_eq!(read, StepCheckpointed { provider: None, cost_micros: None, ..sample });
    let v1 = std::fs::read(golden_dir().join("history/SignalReceived.v1.bin")).expect("v1 golden");
    let (Ok(Event::SignalReceived(read)), Event::SignalReceived(sample)) = (decode(&v1), sample_of("SignalReceived"))
    else {
        panic!("SignalReceived v1 bytes do not decode")
    };
    assert_eq!(read, SignalReceived { step: None, generation: None, decision: None, ..sample });
}
