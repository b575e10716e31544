-- Tables of the fenced consumer and the outbox (DESIGN.md sections 4 and 5). Every
-- service has them in its own schema.

-- Progress per partition. The database, not the broker, is the authority: an
-- instance that takes a partition over bumps `epoch`, and every batch advances
-- `next_offset` only while its epoch is still the current one.
CREATE TABLE consumer_partitions (
    consumer_group text NOT NULL,
    topic text NOT NULL,
    partition integer NOT NULL,
    epoch bigint NOT NULL,
    -- NULL: never handled; start at the beginning of the partition.
    next_offset bigint,
    -- The instance holding the current epoch, for operators.
    owner text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition)
);

-- Event ids already applied, so a projection changes once per event even when the
-- same event arrives twice (a relay re-send) at different offsets.
CREATE TABLE processed_events (
    consumer_group text NOT NULL,
    event_id uuid NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_id)
);
CREATE INDEX processed_events_by_age ON processed_events (processed_at);

-- Events written in the same transaction as the state change that caused them.
CREATE TABLE outbox (
    id bigserial PRIMARY KEY,
    shard smallint NOT NULL,
    topic text NOT NULL,
    record_key bytea,
    payload bytea NOT NULL,
    event_id uuid NOT NULL UNIQUE,
    event_type text NOT NULL,
    schema_fingerprint text NOT NULL,
    producer text NOT NULL,
    produced_at_us bigint NOT NULL,
    traceparent text,
    created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX outbox_unpublished ON outbox (shard, id) WHERE published_at IS NULL;
CREATE INDEX outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;
