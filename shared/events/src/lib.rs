//! Fenceline's events on the wire (docs/architecture.md, "Topics and events"): one Avro schema per event
//! type in `schemas/`, Avro single-object encoding for record values, and the
//! record headers every producer sets.

mod codec;
mod headers;
mod timestamp;
pub mod topics;
mod types;

pub use codec::{DecodeError, EncodeError, SchemaRegistry, decode, encode, encode_record, registry};
pub use headers::{HeaderError, Headers, header_names};
pub use timestamp::{OutOfRange, Timestamp};
pub use types::*;

/// A decoded record: its headers and its event.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub headers: Headers,
    pub event: Event,
}
