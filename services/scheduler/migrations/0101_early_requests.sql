-- A person's request (cancel, signal, resolution) for a task whose TaskAccepted
-- has not arrived yet: per-key order on fenceline.tasks can break after a delivery
-- timeout. Applied, in `seq` order, and deleted when the task arrives; rows for a
-- task that never arrives are purged after the consumer's dedup retention.
CREATE TABLE early_requests (
    seq bigserial PRIMARY KEY,
    task_id uuid NOT NULL,
    event_id uuid NOT NULL UNIQUE,
    -- The record's value as it arrived (single-object Avro).
    value bytea NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX early_requests_by_task ON early_requests (task_id);
