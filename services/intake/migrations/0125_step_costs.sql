-- The provider each checkpointed call went to and what it cost (millionths of the
-- currency's minor unit; null: unpriced), for a task's view and GET /v1/spend.
ALTER TABLE task_steps ADD COLUMN provider text, ADD COLUMN cost_micros bigint;
CREATE INDEX task_steps_by_checkpoint ON task_steps (checkpointed_at) WHERE cost_micros IS NOT NULL;
