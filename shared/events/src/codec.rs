//! Avro single-object encoding (marker `C3 01`, the writer schema's 8-byte Rabin
//! fingerprint, little-endian, then the datum), with every schema Fenceline has
//! ever written known by its fingerprint, so a reader resolves old records to the
//! current schema.

use std::collections::HashMap;
use std::sync::LazyLock;

use apache_avro::rabin::Rabin;
use apache_avro::{Schema, from_avro_datum, to_avro_datum};

use crate::types::{from_avro_value, to_avro_value};
use crate::{Envelope, Event, Headers};

mod files {
    include!(concat!(env!("OUT_DIR"), "/schema_files.rs"));
}

/// Do not change: the single-object encoding marker of the Avro specification.
const MARKER: [u8; 2] = [0xC3, 0x01];
const PREFIX_LEN: usize = 10;

#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("no schema for event type {0}")]
    NoSchema(&'static str),
    #[error("encoding {event_type} against its schema: {source}")]
    Avro {
        event_type: &'static str,
        #[source]
        source: Box<apache_avro::Error>,
    },
}

/// Why a record could not be read. Each is a reason to dead-letter the record.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("value is not Avro single-object encoded: {0}")]
    NotSingleObject(&'static str),
    #[error("unknown schema fingerprint {0}")]
    UnknownSchema(String),
    /// A record of a type this build knows, written (its headers and value agree)
    /// with a schema it does not know yet: most likely a producer deployed before
    /// this consumer. Not the record's fault; it reads once this build is upgraded.
    #[error(
        "{event_type} written with schema fingerprint {fingerprint}, which this build does not know \
         (a newer producer? deploy consumers first, docs/wire.md)"
    )]
    NewerSchema { event_type: String, fingerprint: String },
    #[error("value does not match its writer schema {event_type}: {reason}")]
    Malformed { event_type: &'static str, reason: String },
    #[error("header says {header} but the value is a {payload}")]
    TypeMismatch { header: String, payload: &'static str },
    #[error(transparent)]
    Header(#[from] crate::HeaderError),
}

/// A schema a record may have been written with.
#[derive(Debug)]
struct KnownSchema {
    event_type: &'static str,
    schema: Schema,
}

/// Every schema by fingerprint, and the current one of every event type.
#[derive(Debug)]
pub struct SchemaRegistry {
    by_fingerprint: HashMap<[u8; 8], KnownSchema>,
    current: HashMap<&'static str, (Schema, [u8; 8])>,
}

fn fingerprint(schema: &Schema) -> [u8; 8] {
    let bytes = schema.fingerprint::<Rabin>().bytes;
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[..8]);
    out
}

fn parse(event_type: &str, label: &str, json: &str) -> Schema {
    // The schemas are compiled in; one that does not parse is a build defect that
    // the events tests catch before anything ships.
    Schema::parse_str(json).unwrap_or_else(|e| panic!("schema {event_type} ({label}) does not parse: {e}"))
}

impl SchemaRegistry {
    fn load() -> Self {
        let mut by_fingerprint = HashMap::new();
        let mut current = HashMap::new();
        for &(event_type, json) in files::CURRENT {
            let schema = parse(event_type, "current", json);
            let fp = fingerprint(&schema);
            current.insert(event_type, (schema.clone(), fp));
            by_fingerprint.insert(fp, KnownSchema { event_type, schema });
        }
        for &(event_type, label, json) in files::HISTORY {
            let schema = parse(event_type, label, json);
            by_fingerprint.entry(fingerprint(&schema)).or_insert(KnownSchema { event_type, schema });
        }
        Self { by_fingerprint, current }
    }

    /// The current schema of an event type and its fingerprint.
    pub fn current(&self, event_type: &str) -> Option<(&Schema, [u8; 8])> {
        self.current.get(event_type).map(|(schema, fp)| (schema, *fp))
    }

    /// Earlier schemas of an event type, with their labels, oldest first.
    pub fn history(&self, event_type: &str) -> Vec<(&'static str, Schema)> {
        files::HISTORY
            .iter()
            .filter(|(t, _, _)| *t == event_type)
            .map(|&(t, label, json)| (label, parse(t, label, json)))
            .collect()
    }

    /// Event types with a current schema.
    pub fn event_types(&self) -> Vec<&'static str> {
        let mut types: Vec<_> = self.current.keys().copied().collect();
        types.sort_unstable();
        types
    }
}

static REGISTRY: LazyLock<SchemaRegistry> = LazyLock::new(SchemaRegistry::load);

/// The process-wide registry of every schema.
pub fn registry() -> &'static SchemaRegistry {
    &REGISTRY
}

/// Encodes an event as an Avro single object with its current schema. Returns the
/// bytes and the schema fingerprint (for the `schema_fingerprint` header).
pub fn encode(event: &Event) -> Result<(Vec<u8>, [u8; 8]), EncodeError> {
    let event_type = event.event_type();
    let (schema, fp) = registry().current(event_type).ok_or(EncodeError::NoSchema(event_type))?;
    let avro = |source: apache_avro::Error| EncodeError::Avro { event_type, source: Box::new(source) };
    let value = to_avro_value(event).map_err(avro)?.resolve(schema).map_err(avro)?;
    let datum = to_avro_datum(schema, value).map_err(avro)?;
    let mut out = Vec::with_capacity(PREFIX_LEN + datum.len());
    out.extend_from_slice(&MARKER);
    out.extend_from_slice(&fp);
    out.extend_from_slice(&datum);
    Ok((out, fp))
}

/// Encodes an event and makes the headers of a new record of it, as an outside
/// producer (an upstream system, a test) writes it straight to a topic.
pub fn encode_record(event: &Event, producer: &str) -> Result<(Vec<u8>, Headers), EncodeError> {
    let (payload, fingerprint) = encode(event)?;
    let headers = Headers {
        event_id: fenceline_domain::ids::EventId::new_v7(),
        event_type: event.event_type().to_owned(),
        schema_fingerprint: hex::encode(fingerprint),
        producer: producer.to_owned(),
        produced_at: crate::Timestamp::now(),
        traceparent: None,
    };
    Ok((payload, headers))
}

/// Decodes a single-object encoded value written with any known schema, resolved to
/// the current schema of its type.
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    if bytes.len() < PREFIX_LEN {
        return Err(DecodeError::NotSingleObject("shorter than the 10-byte prefix"));
    }
    if bytes[..2] != MARKER {
        return Err(DecodeError::NotSingleObject("missing the C3 01 marker"));
    }
    let mut fp = [0u8; 8];
    fp.copy_from_slice(&bytes[2..PREFIX_LEN]);
    let writer = registry().by_fingerprint.get(&fp).ok_or_else(|| DecodeError::UnknownSchema(hex::encode(fp)))?;
    let event_type = writer.event_type;
    let malformed = |reason: String| DecodeError::Malformed { event_type, reason };
    let (reader, _) =
        registry().current(event_type).ok_or_else(|| malformed("no current schema for this type".into()))?;
    let mut datum = &bytes[PREFIX_LEN..];
    let value = from_avro_datum(&writer.schema, &mut datum, Some(reader)).map_err(|e| malformed(e.to_string()))?;
    if !datum.is_empty() {
        return Err(malformed(format!("{} bytes left after the datum", datum.len())));
    }
    from_avro_value(event_type, &value)
        .ok_or_else(|| malformed("no Rust type for this event type".into()))?
        .map_err(|e| malformed(e.to_string()))
}

impl Envelope {
    /// Reads a Kafka record: its headers and value must agree on the event type.
    pub fn decode<'a>(
        headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>,
        value: &[u8],
    ) -> Result<Self, DecodeError> {
        let headers = Headers::from_pairs(headers)?;
        let event = match decode(value) {
            // The headers name a type this build knows and the fingerprint the value
            // carries: a newer version of it, not a broken record.
            Err(DecodeError::UnknownSchema(fingerprint))
                if headers.schema_fingerprint.eq_ignore_ascii_case(&fingerprint)
                    && registry().current(&headers.event_type).is_some() =>
            {
                return Err(DecodeError::NewerSchema { event_type: headers.event_type, fingerprint });
            }
            other => other?,
        };
        if headers.event_type != event.event_type() {
            return Err(DecodeError::TypeMismatch { header: headers.event_type, payload: event.event_type() });
        }
        Ok(Self { headers, event })
    }
}
