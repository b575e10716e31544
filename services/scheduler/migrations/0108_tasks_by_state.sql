-- Unfinished tasks by state, as `GET /metrics` counts them at each scrape
-- (`fenceline_scheduler_tasks`, docs/operations.md): each unfinished state is
-- read from this index, without a pass over the finished tasks kept for their
-- retention.
CREATE INDEX tasks_by_state ON tasks (state);
