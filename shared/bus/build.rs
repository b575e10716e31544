//! Rebuilds the crate when a migration is added or changed: `sqlx::migrate!` embeds
//! the `migrations/` folder at compile time, and cargo does not see that folder
//! otherwise, so a build could run without its newest migration.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
