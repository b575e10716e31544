//! Outbox decisions: which shard a key belongs to, and how far a relay may mark
//! rows published after a round of deliveries (docs/architecture.md, "The outbox").

use sha2::{Digest, Sha256};

/// The shard of the outbox that holds the events of `key`. Every event of one key
/// lands in one shard, so one relay publishes them, in order.
///
/// Do not change: relays of different versions running side by side must agree on
/// the shard of every key, or per-key order breaks during a rolling deploy.
pub fn shard_for_key(key: &[u8], shards: u16) -> u16 {
    let digest = Sha256::digest(key);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let shards = u64::from(shards.max(1));
    // The remainder is below `shards`, which fits in u16.
    (u64::from_be_bytes(first) % shards) as u16
}

/// How many rows, from the start of a round, may be marked published: the longest
/// run of confirmed deliveries. A row after an unconfirmed one is re-sent with it
/// (consumers dedupe by event id), so marking never jumps over a gap and a key's
/// events are never confirmed out of order.
pub fn publishable_prefix(delivered: &[bool]) -> usize {
    delivered.iter().take_while(|&&ok| ok).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_of_a_key_is_pinned() {
        // Do not change: pins the formula across versions.
        assert_eq!(shard_for_key(b"0190f6c8-0000-7000-8000-000000000001", 8), 1);
        assert_eq!(shard_for_key(b"tenant-a", 16), 1);
        assert_eq!(shard_for_key(b"anything", 1), 0);
        assert_eq!(shard_for_key(b"anything", 0), 0, "zero shards is read as one");
    }

    #[test]
    fn marking_stops_at_the_first_unconfirmed_row() {
        assert_eq!(publishable_prefix(&[]), 0);
        assert_eq!(publishable_prefix(&[true, true]), 2);
        assert_eq!(publishable_prefix(&[true, false, true]), 1);
        assert_eq!(publishable_prefix(&[false, true]), 0);
    }
}
