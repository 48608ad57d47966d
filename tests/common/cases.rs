//! How many cases a property test runs: its own quick default, or `PROPTEST_CASES` when set,
//! so a long run (`PROPTEST_CASES=5000 cargo test --release --test engine_props`) needs no
//! edit. An explicit `cases:` in a `proptest_config` would otherwise override the variable.

/// `PROPTEST_CASES` if it is set to a number, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
