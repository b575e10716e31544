-- Whether any answer showed that the provider received the call in doubt: it
-- accepted it under a request id, or a look-up found it. Evidence only moves
-- toward "it happened": once true, a later "never received" is no answer.
ALTER TABLE cases ADD COLUMN received boolean NOT NULL DEFAULT false;
UPDATE cases SET received = true WHERE provider_request_id IS NOT NULL;

-- A loss or an ambiguous end heard before its grant (fenceline.attempts and
-- fenceline.dispatch keep no order between them): the case needs the grant's kind,
-- deadline and provider, so it opens when the grant arrives.
CREATE TABLE early_losses (
    task_id uuid NOT NULL,
    attempt integer NOT NULL,
    lost jsonb NOT NULL,
    heard_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, attempt)
);
