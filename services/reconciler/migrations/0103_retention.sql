-- Finished tasks' rows are purged after FENCELINE_RECONCILER_RETENTION_DAYS: find
-- the oldest finished tasks without reading the open ones, and their grants by task.
CREATE INDEX task_states_finished ON task_states (updated_at_us)
    WHERE state IN ('succeeded', 'failed', 'cancelled');
CREATE INDEX grants_by_task ON grants (task_id);
