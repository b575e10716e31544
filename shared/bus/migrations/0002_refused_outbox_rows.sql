-- Rows the broker can never take (larger than its record limit, or invalid) are kept
-- with the reason, out of the relay's way, and announced on fenceline.deadletter, so a
-- shard never stops behind one of them (docs/bus.md, "Outbox").
ALTER TABLE outbox ADD COLUMN refused_at timestamptz, ADD COLUMN refused_reason text;
DROP INDEX outbox_unpublished;
CREATE INDEX outbox_unpublished ON outbox (shard, id) WHERE published_at IS NULL AND refused_at IS NULL;
CREATE INDEX outbox_refused ON outbox (refused_at) WHERE refused_at IS NOT NULL;
