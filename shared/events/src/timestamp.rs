//! Instants on the wire: microseconds since the Unix epoch, UTC (Avro
//! `timestamp-micros`).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// Microseconds since 1970-01-01T00:00:00Z.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(pub i64);

impl Timestamp {
    pub fn now() -> Self {
        Self::from(OffsetDateTime::now_utc())
    }

    pub fn to_datetime(self) -> OffsetDateTime {
        // Out of range only for instants beyond year 9999; clamp rather than fail.
        OffsetDateTime::from_unix_timestamp_nanos(i128::from(self.0) * 1_000).unwrap_or(OffsetDateTime::UNIX_EPOCH)
    }

    /// RFC 3339 text, as in headers and logs.
    pub fn to_rfc3339(self) -> String {
        self.to_datetime().format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| self.0.to_string())
    }
}

impl From<OffsetDateTime> for Timestamp {
    fn from(value: OffsetDateTime) -> Self {
        // i64 microseconds cover ±292,000 years.
        Self((value.unix_timestamp_nanos() / 1_000) as i64)
    }
}
