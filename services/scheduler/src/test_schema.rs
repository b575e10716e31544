//! A schema of its own in the test Postgres for each store test, migrated as the
//! scheduler migrates its own, so that store tests run side by side on empty tables
//! without the rest of the system (`deploy/local/stack test` exports the server's URL).

/// Connects to a new schema holding the bus tables and the scheduler's.
pub(crate) async fn fresh() -> fenceline_store::Database {
    let url = std::env::var("FENCELINE_TEST_DATABASE_URL")
        .expect("FENCELINE_TEST_DATABASE_URL: run `deploy/local/stack test`");
    let config = fenceline_config::PostgresConfig::at(&url, Some(&format!("t_{}", uuid::Uuid::now_v7().simple())), 4);
    fenceline_store::connect(&config, crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR])
        .await
        .expect("a fresh schema")
}
