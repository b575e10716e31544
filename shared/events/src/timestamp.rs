//! Instants on the wire: microseconds since the Unix epoch, UTC (Avro
//! `timestamp-micros`).

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// Microseconds since 1970-01-01T00:00:00Z.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(pub i64);

/// An instant that is not microseconds from 1970 to the end of year 9999: most
/// likely nanoseconds or milliseconds, or a negative number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0} is not an instant from 1970-01-01 to 9999-12-31: instants are microseconds since \
     1970-01-01T00:00:00Z (was it sent in nanoseconds?)"
)]
pub struct OutOfRange(pub i64);

impl Timestamp {
    pub fn now() -> Self {
        Self::from(OffsetDateTime::now_utc())
    }

    /// The instant, if it is one Fenceline accepts: from the epoch to the end of
    /// year 9999. Every instant another party sends is read with this, so that a
    /// value in the wrong unit is refused rather than taken for another instant.
    pub fn checked(self) -> Result<OffsetDateTime, OutOfRange> {
        if self.0 < 0 {
            return Err(OutOfRange(self.0));
        }
        OffsetDateTime::from_unix_timestamp_nanos(i128::from(self.0) * 1_000).map_err(|_| OutOfRange(self.0))
    }

    /// The instant, for the ones Fenceline's own services wrote (always in range).
    /// Out of range only for a value no Fenceline producer writes; it then reads as
    /// the epoch. Values from other parties go through [`Timestamp::checked`].
    pub fn to_datetime(self) -> OffsetDateTime {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_in_the_wrong_unit_or_before_1970_are_refused_not_clamped() {
        let now = OffsetDateTime::now_utc().replace_nanosecond(123_000).expect("micros");
        assert_eq!(Timestamp::from(now).checked(), Ok(now));
        assert_eq!(Timestamp(0).checked(), Ok(OffsetDateTime::UNIX_EPOCH));
        let in_nanoseconds = Timestamp((now.unix_timestamp_nanos()) as i64);
        assert_eq!(in_nanoseconds.checked(), Err(OutOfRange(in_nanoseconds.0)));
        assert_eq!(Timestamp(-1).checked(), Err(OutOfRange(-1)));
        assert_eq!(Timestamp(i64::MAX).checked(), Err(OutOfRange(i64::MAX)));
        // The last microsecond of 9999 is an instant; the next is not.
        let last = 253_402_300_799_999_999;
        assert!(Timestamp(last).checked().is_ok());
        assert_eq!(Timestamp(last + 1).checked(), Err(OutOfRange(last + 1)));
        assert!(OutOfRange(-1).to_string().contains("microseconds"));
    }
}
