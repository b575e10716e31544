//! Words of the domain's closed sets as row values: written as their text, read
//! back as the typed word, and a stored text that is no such word is a decode
//! error naming it, never a string passed on.

use fenceline_domain::vocabulary::Word;
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo, PgValueRef};
use sqlx::{Decode, Encode, Postgres, Type};

/// A word in a `text` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stored<W>(pub W);

impl<W: Word> Type<Postgres> for Stored<W> {
    fn type_info() -> PgTypeInfo {
        <&str as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <&str as Type<Postgres>>::compatible(ty)
    }
}

impl<'r, W: Word> Decode<'r, Postgres> for Stored<W> {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        let text = <&str as Decode<Postgres>>::decode(value)?;
        Ok(Stored(text.parse()?))
    }
}

impl<W: Word> Encode<'_, Postgres> for Stored<W> {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <&str as Encode<Postgres>>::encode(self.0.as_str(), buf)
    }
}

/// Shown as the word itself: a view can hold a stored word and be served as it is.
impl<W: Word + serde::Serialize> serde::Serialize for Stored<W> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de, W: Word + serde::Deserialize<'de>> serde::Deserialize<'de> for Stored<W> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        W::deserialize(deserializer).map(Stored)
    }
}
