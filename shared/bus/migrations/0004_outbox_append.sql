-- How a writer appends to the outbox: a statement hands its rows over as one
-- `outbox_entry[]` parameter to `outbox_append`, so that every statement that writes
-- events is whole where it is written (docs/bus.md, "Outbox").

-- One outbox row as a writer hands it over, in the order of the outbox's columns.
CREATE TYPE outbox_entry AS (
    shard smallint,
    topic text,
    record_key bytea,
    payload bytea,
    event_id uuid,
    event_type text,
    schema_fingerprint text,
    producer text,
    produced_at_us bigint,
    traceparent text
);

-- Appends `entries` in the order given; returns how many. Every record key's
-- transaction lock is taken first, in key order, before the first row's id is drawn:
-- a writer of the same key waits for the earlier one to commit, so rows of one key
-- get ids in commit order and a relay never publishes a later row before an earlier
-- one. The lock's expression is shared with writers of earlier versions; do not
-- change it.
CREATE FUNCTION outbox_append(entries outbox_entry[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    appended integer;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(current_schema() || ':outbox-key:' || encode(k, 'escape'), 0))
    FROM (SELECT DISTINCT e.record_key AS k FROM unnest(entries) AS e WHERE e.record_key IS NOT NULL ORDER BY 1) AS keys;
    INSERT INTO outbox (shard, topic, record_key, payload, event_id, event_type, schema_fingerprint, producer,
                        produced_at_us, traceparent)
    SELECT e.shard, e.topic, e.record_key, e.payload, e.event_id, e.event_type, e.schema_fingerprint, e.producer,
           e.produced_at_us, e.traceparent
    FROM unnest(entries) WITH ORDINALITY AS e
    ORDER BY e.ordinality;
    GET DIAGNOSTICS appended = ROW_COUNT;
    RETURN appended;
END
$$;
