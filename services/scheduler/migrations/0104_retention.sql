-- The retention's questions (docs/decisions.md, entry 13): the oldest finished
-- tasks first, and every row a purged task leaves in the other tables.
CREATE INDEX tasks_finished ON tasks (updated_at) WHERE state IN ('succeeded', 'failed', 'cancelled');
CREATE INDEX slots_by_task ON slots (task_id);
