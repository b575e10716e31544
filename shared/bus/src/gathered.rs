//! What a handler gathers over one consumer batch and writes once, just before the
//! batch commits ([`crate::Handler::flush`]), instead of once per event; forgotten
//! when the batch or the event's savepoint rolls back ([`crate::Handler::discard`]).
//! Each consumer owns its handler and applies one batch at a time, so a gathering
//! only ever holds one batch.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The newest value per key (by a version the caller gives), handed back in key
/// order: writing keys in one order in every batch keeps two transactions from
/// waiting on each other's row locks in opposite orders.
#[derive(Debug)]
pub struct Newest<K, V>(Mutex<BTreeMap<K, (i64, V)>>);

impl<K, V> Default for Newest<K, V> {
    fn default() -> Self {
        Self(Mutex::new(BTreeMap::new()))
    }
}

impl<K: Ord, V> Newest<K, V> {
    fn held(&self) -> MutexGuard<'_, BTreeMap<K, (i64, V)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `value` unless the batch holds a version of `key` at least as new.
    /// `make` runs only when the value is kept.
    pub fn keep(&self, key: K, version: i64, make: impl FnOnce() -> V) {
        let mut held = self.held();
        if held.get(&key).is_none_or(|(kept, _)| *kept < version) {
            held.insert(key, (version, make()));
        }
    }

    /// Takes what was gathered, in key order.
    pub fn take(&self) -> Vec<V> {
        std::mem::take(&mut *self.held()).into_values().map(|(_, value)| value).collect()
    }

    /// Forgets what a rolled-back batch gathered.
    pub fn discard(&self) {
        self.held().clear();
    }
}

/// One value per key, built up by each event of the batch that touches the key
/// (`V::default()` first), handed back in key order.
#[derive(Debug)]
pub struct Merged<K, V>(Mutex<BTreeMap<K, V>>);

impl<K, V> Default for Merged<K, V> {
    fn default() -> Self {
        Self(Mutex::new(BTreeMap::new()))
    }
}

impl<K: Ord, V: Default> Merged<K, V> {
    /// Changes the value gathered for `key`.
    pub fn merge(&self, key: K, change: impl FnOnce(&mut V)) {
        change(self.0.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_default());
    }

    /// Takes what was gathered, in key order.
    pub fn take(&self) -> Vec<(K, V)> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_iter().collect()
    }

    /// Forgets what a rolled-back batch gathered.
    pub fn discard(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }
}

/// Everything gathered, in the order it came.
#[derive(Debug)]
pub struct All<V>(Mutex<Vec<V>>);

impl<V> Default for All<V> {
    fn default() -> Self {
        Self(Mutex::new(Vec::new()))
    }
}

impl<V> All<V> {
    pub fn push(&self, value: V) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(value);
    }

    /// Takes what was gathered, in the order it came.
    pub fn take(&self) -> Vec<V> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Forgets what a rolled-back batch gathered.
    pub fn discard(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_version_of_each_key_is_kept_and_handed_back_in_key_order() {
        let newest = Newest::default();
        newest.keep("b", 2, || "b2");
        newest.keep("a", 1, || "a1");
        newest.keep("b", 1, || unreachable!("an older version is not made"));
        newest.keep("a", 3, || "a3");
        newest.keep("b", 2, || unreachable!("the same version is not made again"));
        assert_eq!(newest.take(), vec!["a3", "b2"]);
        assert!(newest.take().is_empty(), "taken once");
        newest.keep("c", 1, || "c1");
        newest.discard();
        assert!(newest.take().is_empty(), "discarded");
    }

    #[test]
    fn merged_values_are_built_per_key_and_handed_back_in_key_order() {
        let merged: Merged<&str, Vec<u8>> = Merged::default();
        merged.merge("b", |v| v.push(1));
        merged.merge("a", |v| v.push(2));
        merged.merge("b", |v| v.push(3));
        assert_eq!(merged.take(), vec![("a", vec![2]), ("b", vec![1, 3])]);
        merged.merge("c", |v| v.push(4));
        merged.discard();
        assert!(merged.take().is_empty(), "discarded");
    }
}
