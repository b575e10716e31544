-- The probe's projection: how often each event was applied, and in what order.
CREATE TABLE probe_applied (
    event_id uuid PRIMARY KEY,
    task_id uuid NOT NULL,
    version bigint NOT NULL,
    applications integer NOT NULL DEFAULT 1,
    applied_seq bigserial NOT NULL
);
