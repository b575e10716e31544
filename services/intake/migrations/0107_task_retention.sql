-- Finished tasks are purged after FENCELINE_INTAKE_TASK_RETENTION_DAYS; this finds
-- the oldest of them without reading the open ones.
CREATE INDEX task_view_finished ON task_view (updated_at) WHERE state IN ('succeeded', 'failed', 'cancelled');
