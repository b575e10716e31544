-- Snapshots written in place (docs/decisions.md, entry 47). Every newer snapshot of
-- a task sets `updated_at` (and most change `state`), both of which
-- `task_view_finished` referred to, so no write of the read model could be a
-- heap-only (HOT) update: each wrote a new entry in every index of the table. The
-- purge now finds finished tasks by `finished_at`, the time of the snapshot that
-- made the task final, which stays NULL while it is open; a snapshot of an open
-- task that finds room on its page is then written in place. Being generated, the
-- column is right for rows the previous release writes during a rolling upgrade
-- too. Adding it rewrites the table once; the room kept free on each page (a fifth)
-- is what lets a snapshot stay on its page.
ALTER TABLE task_view SET (fillfactor = 80);
ALTER TABLE task_view ADD COLUMN finished_at timestamptz
    GENERATED ALWAYS AS (CASE WHEN state IN ('succeeded', 'failed', 'cancelled') THEN updated_at END) STORED;
CREATE INDEX task_view_finished_at ON task_view (finished_at) WHERE finished_at IS NOT NULL;
DROP INDEX task_view_finished;
