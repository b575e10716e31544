//! Sealing of webhook signing secrets at rest (docs/decisions.md, entry 22): the
//! keys from `FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS` (or `_FILE`), and
//! XChaCha20-Poly1305 with the row's source and secret id as associated data, so a
//! sealed value opens in its own row only.

use chacha20poly1305::aead::{Aead, Generate, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use fenceline_config::Secret;
use secrecy::{ExposeSecret, ExposeSecretMut, SecretBox};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// Bytes of one key.
pub const KEY_BYTES: usize = 32;
/// Bytes of the random nonce before each sealed value.
const NONCE_BYTES: usize = 24;
/// Do not change: the prefix of the associated data of every sealed secret.
const CONTEXT: &[u8] = b"fenceline.intake.webhook_secret.v1";

/// Why the configured sealing keys cannot be used. Never holds a key's text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS is set but lists no key")]
    Empty,
    #[error(
        "sealing key {position} is {length} characters long; each key is 64 hex digits (32 bytes, from `openssl rand -hex 32`)"
    )]
    Length { position: usize, length: usize },
    #[error("sealing key {position} holds a character that is not a hex digit; each key is 64 hex digits")]
    NotHex { position: usize },
    #[error("sealing key {position} repeats key {first} (id {id})")]
    Repeated { position: usize, first: usize, id: String },
}

/// Why a sealed secret did not open. Says which row, never what it holds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("secret {secret_id} of source `{webhook_source}` is sealed with key {key_id}, which is not configured")]
    UnknownKey { webhook_source: String, secret_id: Uuid, key_id: String },
    #[error(
        "secret {secret_id} of source `{webhook_source}` does not open with key {key_id}: it was altered or sealed for another row"
    )]
    Refused { webhook_source: String, secret_id: Uuid, key_id: String },
}

/// One key and its id (the first 16 hex digits of the key's sha256).
struct SealingKey {
    id: String,
    cipher: XChaCha20Poly1305,
    /// Kept only so that the key is wiped when dropped; the cipher holds its copy.
    _key: SecretBox<[u8; KEY_BYTES]>,
}

/// The configured keys: the first seals, every one opens. `Debug` shows the ids only.
pub struct SealingKeys {
    keys: Vec<SealingKey>,
}

impl std::fmt::Debug for SealingKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealingKeys").field("ids", &self.ids()).finish()
    }
}

/// A secret as sealed into its row: what goes into `sealed_secret` and `sealing_key_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub bytes: Vec<u8>,
    pub key_id: String,
}

/// The id of a key: enough of its sha256 to tell keys apart, nothing to open with.
fn key_id(key: &[u8; KEY_BYTES]) -> String {
    let digest = Sha256::digest([b"fenceline.intake.sealing_key_id\0".as_slice(), key].concat());
    hex::encode(&digest[..8])
}

/// Do not change: binds a sealed value to its row.
fn associated_data(source: &str, secret_id: Uuid) -> Vec<u8> {
    [CONTEXT, b"\0", source.as_bytes(), b"\0", secret_id.as_bytes()].concat()
}

impl SealingKeys {
    /// Parses the keys: 64 hex digits each, separated by commas, spaces or new lines
    /// (a file may hold one a line). No error repeats a key's text.
    pub fn parse(text: &Secret) -> Result<Self, KeyError> {
        let mut keys: Vec<SealingKey> = Vec::new();
        let items = text.expose_secret().split([',', ' ', '\n', '\r', '\t']).filter(|s| !s.is_empty());
        for (index, item) in items.enumerate() {
            let position = index + 1;
            if item.len() != 2 * KEY_BYTES {
                return Err(KeyError::Length { position, length: item.chars().count() });
            }
            let mut key = SecretBox::new(Box::new([0u8; KEY_BYTES]));
            hex::decode_to_slice(item, key.expose_secret_mut().as_mut_slice())
                .map_err(|_| KeyError::NotHex { position })?;
            let id = key_id(key.expose_secret());
            if let Some(first) = keys.iter().position(|k| k.id == id) {
                return Err(KeyError::Repeated { position, first: first + 1, id });
            }
            let cipher = XChaCha20Poly1305::new(&Key::from(*key.expose_secret()));
            keys.push(SealingKey { id, cipher, _key: key });
        }
        if keys.is_empty() { Err(KeyError::Empty) } else { Ok(Self { keys }) }
    }

    /// The ids of the keys, the sealing one first.
    pub fn ids(&self) -> Vec<&str> {
        self.keys.iter().map(|k| k.id.as_str()).collect()
    }

    /// The id of the key that seals.
    pub fn sealing_id(&self) -> &str {
        &self.keys[0].id
    }

    /// Whether `key_id` is one of the configured keys.
    pub fn knows(&self, key_id: &str) -> bool {
        self.keys.iter().any(|k| k.id == key_id)
    }

    /// Seals `secret` for the row (`source`, `secret_id`) with the first key under a
    /// fresh random nonce.
    pub fn seal(&self, source: &str, secret_id: Uuid, secret: &str) -> Sealed {
        let key = &self.keys[0];
        let nonce = XNonce::generate();
        let aad = associated_data(source, secret_id);
        let sealed = key
            .cipher
            .encrypt(&nonce, Payload { msg: secret.as_bytes(), aad: &aad })
            .unwrap_or_else(|_| unreachable!("XChaCha20-Poly1305 seals any secret shorter than 256 GiB"));
        Sealed { bytes: [nonce.as_slice(), &sealed].concat(), key_id: key.id.clone() }
    }

    /// Opens the secret sealed in the row (`source`, `secret_id`) with key `key_id`.
    pub fn open(&self, source: &str, secret_id: Uuid, key_id: &str, sealed: &[u8]) -> Result<Secret, OpenError> {
        let Some(key) = self.keys.iter().find(|k| k.id == key_id) else {
            return Err(OpenError::UnknownKey {
                webhook_source: source.to_owned(),
                secret_id,
                key_id: key_id.to_owned(),
            });
        };
        let refused = || OpenError::Refused { webhook_source: source.to_owned(), secret_id, key_id: key_id.to_owned() };
        let (nonce, ciphertext) = sealed.split_at_checked(NONCE_BYTES).ok_or_else(refused)?;
        let nonce = XNonce::try_from(nonce).map_err(|_| refused())?;
        let aad = associated_data(source, secret_id);
        let clear = key.cipher.decrypt(&nonce, Payload { msg: ciphertext, aad: &aad }).map_err(|_| refused())?;
        String::from_utf8(clear).map(Secret::from).map_err(|_| refused())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f00112233445566778899aabbccddeeff0";
    const SECOND: &str = "a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebfc0";

    fn keys(text: &str) -> Result<SealingKeys, KeyError> {
        SealingKeys::parse(&Secret::from(text.to_owned()))
    }

    #[test]
    fn keys_are_64_hex_digits_separated_by_commas_or_lines() {
        let parsed = keys(&format!("{FIRST}, {SECOND}\n")).expect("two keys");
        assert_eq!(parsed.ids().len(), 2);
        assert_eq!(parsed.sealing_id(), parsed.ids()[0]);
        assert_eq!(keys(&format!("{FIRST}\n{SECOND}")).expect("one a line").ids(), parsed.ids());
        let upper = keys(&FIRST.to_uppercase()).expect("upper case hex");
        assert_eq!(upper.ids()[0], parsed.ids()[0], "the id depends on the key's bytes only");
        assert_ne!(parsed.ids()[0], parsed.ids()[1]);
        assert_eq!(parsed.ids()[0].len(), 16);
    }

    #[test]
    fn malformed_keys_are_refused_without_repeating_them() {
        let short = &FIRST[..40];
        let not_hex = format!("{}zz", &FIRST[..62]);
        let cases = [
            (String::new(), KeyError::Empty),
            (" ,\n".to_owned(), KeyError::Empty),
            (short.to_owned(), KeyError::Length { position: 1, length: 40 }),
            (format!("{FIRST},{short}"), KeyError::Length { position: 2, length: 40 }),
            (not_hex.clone(), KeyError::NotHex { position: 1 }),
        ];
        for (text, expected) in cases {
            let refused = keys(&text).expect_err("malformed");
            assert_eq!(refused, expected);
            let message = refused.to_string();
            assert!(text.is_empty() || !message.contains(text.trim()), "{message}");
            assert!(!message.contains(&FIRST[..16]) && !message.contains(short), "{message}");
        }
        let repeated = keys(&format!("{FIRST},{SECOND},{FIRST}")).expect_err("repeated");
        assert!(matches!(repeated, KeyError::Repeated { position: 3, first: 1, .. }), "{repeated}");
        assert!(!repeated.to_string().contains(FIRST), "{repeated}");
    }

    #[test]
    fn debug_shows_key_ids_never_key_bytes() {
        let parsed = keys(&format!("{FIRST},{SECOND}")).expect("keys");
        let printed = format!("{parsed:?}");
        assert!(printed.contains(parsed.ids()[0]) && printed.contains(parsed.ids()[1]), "{printed}");
        for key in [FIRST, SECOND] {
            assert!(!printed.to_lowercase().contains(&key[..8]), "{printed}");
        }
        // Nor as the bytes' decimal list.
        let bytes = hex::decode(FIRST).expect("hex");
        assert!(!printed.contains(&format!("{}, {}, {}", bytes[0], bytes[1], bytes[2])), "{printed}");
    }

    #[test]
    fn a_sealed_secret_opens_in_its_own_row_only() {
        let parsed = keys(FIRST).expect("key");
        let id = Uuid::now_v7();
        let sealed = parsed.seal("helpdesk", id, "whsec_known_5c1d");
        assert!(!sealed.bytes.windows(16).any(|w| w == b"whsec_known_5c1d"));
        let opened = parsed.open("helpdesk", id, &sealed.key_id, &sealed.bytes).expect("opens");
        assert_eq!(opened.expose_secret(), "whsec_known_5c1d");
        assert_ne!(parsed.seal("helpdesk", id, "whsec_known_5c1d").bytes, sealed.bytes, "a fresh nonce each time");

        let other = Uuid::now_v7();
        for (source, secret_id) in [("helpdesk", other), ("billing", id)] {
            let moved = parsed.open(source, secret_id, &sealed.key_id, &sealed.bytes).expect_err("another row");
            assert!(matches!(moved, OpenError::Refused { .. }), "{moved}");
        }
        let mut altered = sealed.bytes.clone();
        altered[30] ^= 1;
        assert!(parsed.open("helpdesk", id, &sealed.key_id, &altered).is_err());
        assert!(parsed.open("helpdesk", id, &sealed.key_id, &sealed.bytes[..10]).is_err());
        let unknown = parsed.open("helpdesk", id, "0000000000000000", &sealed.bytes).expect_err("no such key");
        assert!(matches!(unknown, OpenError::UnknownKey { .. }), "{unknown}");
    }

    #[test]
    fn every_listed_key_opens_and_the_first_seals() {
        let old = keys(SECOND).expect("old");
        let id = Uuid::now_v7();
        let sealed = old.seal("helpdesk", id, "s3cret");
        let rotated = keys(&format!("{FIRST},{SECOND}")).expect("rotated");
        assert_eq!(
            rotated.open("helpdesk", id, &sealed.key_id, &sealed.bytes).expect("old key").expose_secret(),
            "s3cret"
        );
        let resealed = rotated.seal("helpdesk", id, "s3cret");
        assert_eq!(resealed.key_id, rotated.sealing_id());
        assert!(old.open("helpdesk", id, &resealed.key_id, &resealed.bytes).is_err(), "the old list lacks the new key");
    }
}
