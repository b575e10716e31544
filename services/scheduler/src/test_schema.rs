//! A schema of its own in the test Postgres for each store test, migrated as the
//! scheduler migrates its own ([`fenceline_store::fresh_test_schema`]).

/// Connects to a new schema holding the bus tables and the scheduler's.
pub(crate) async fn fresh() -> fenceline_store::Database {
    fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await
}
