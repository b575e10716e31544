-- The trace a task was accepted in (W3C traceparent): what people later ask about
-- the task (signals, cancels, resolutions, decisions) continues it, so that one
-- task is one trace.
ALTER TABLE tasks ADD COLUMN traceparent text;
