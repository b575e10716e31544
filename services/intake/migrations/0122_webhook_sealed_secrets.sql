-- Webhook signing secrets sealed at rest (docs/decisions.md, entry 22): with
-- FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS set, a row holds its secret sealed with
-- XChaCha20-Poly1305 (a 24-byte nonce, then the ciphertext and its tag; the source
-- and secret id are the associated data) and the id of the key, and `secret` is
-- NULL. Expand only: the previous release reads `secret` alone, so the keys are set
-- once every intake runs this release (docs/deploy.md).
ALTER TABLE webhook_secrets
    ADD COLUMN sealed_secret bytea,
    ADD COLUMN sealing_key_id text,
    ALTER COLUMN secret DROP NOT NULL;

-- Every row holds its secret one way or the other.
ALTER TABLE webhook_secrets
    ADD CONSTRAINT webhook_secrets_held CHECK (
        secret IS NOT NULL OR (sealed_secret IS NOT NULL AND sealing_key_id IS NOT NULL)
    );
