-- Saves in place (docs/decisions.md, entry 47). Every save sets `updated_at`, which
-- `tasks_finished` indexed for the retention's purge, so no save of a task could be
-- a heap-only (HOT) update: each wrote a new entry in every index of the table. The
-- purge now finds finished tasks by `finished_at`, the time of the change that made
-- the task final, which stays NULL through every save of an open task; a save that
-- changes no other indexed column (the task's state or due time) and finds room on
-- its page is then written in place, with no index entry. Being generated, the
-- column is right for rows the previous release writes during a rolling upgrade
-- too. Adding it rewrites the table once; the room kept free on each page (a fifth)
-- is what lets a save stay on its page.
ALTER TABLE tasks SET (fillfactor = 80);
ALTER TABLE tasks ADD COLUMN finished_at timestamptz
    GENERATED ALWAYS AS (CASE WHEN state IN ('succeeded', 'failed', 'cancelled') THEN updated_at END) STORED;
CREATE INDEX tasks_finished_at ON tasks (finished_at) WHERE finished_at IS NOT NULL;
DROP INDEX tasks_finished;
