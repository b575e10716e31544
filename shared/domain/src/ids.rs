//! Typed identities. Past the boundary where they are parsed, nothing is a bare
//! string or integer.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// An identity is not a UUID of the expected kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} must be a UUID: {reason}")]
pub struct InvalidId {
    pub what: &'static str,
    pub reason: String,
}

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Uuid);

        // Always the hyphenated text form, also in binary formats (Avro), where
        // `Uuid`'s own impl would write 16 raw bytes.
        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(&self.0.hyphenated())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = String::deserialize(deserializer)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }

        impl $name {
            /// A new time-ordered (v7) identity.
            pub fn new_v7() -> Self {
                Self(Uuid::now_v7())
            }
            pub fn from_uuid(uuid: Uuid) -> Self {
                Self(uuid)
            }
            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl std::str::FromStr for $name {
            type Err = InvalidId;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self).map_err(|e| InvalidId { what: $what, reason: e.to_string() })
            }
        }
    };
}

uuid_id!(
    /// One event on the wire; consumers dedupe by it.
    EventId,
    "event id"
);
uuid_id!(
    /// One unit of business work.
    TaskId,
    "task id"
);
uuid_id!(
    /// The scheduler's permission for one attempt.
    GrantId,
    "grant id"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_and_print_the_same_text() {
        let id = TaskId::new_v7();
        let parsed: TaskId = id.to_string().parse().expect("round trip");
        assert_eq!(id, parsed);
        let err = "not-a-uuid".parse::<TaskId>().expect_err("garbage");
        assert_eq!(err.what, "task id");
    }

    #[test]
    fn v7_ids_sort_by_creation() {
        let first = EventId::new_v7();
        let second = EventId::new_v7();
        assert!(first < second);
    }
}
