-- A row without a payload is a tombstone: the relay publishes its key with a null
-- value, so that compaction drops every record of the key (docs/wire.md,
-- "Tombstones on fenceline.status").
ALTER TABLE outbox ALTER COLUMN payload DROP NOT NULL;
