//! The end-of-test check shared by the bad-input suites: nothing leaked, nothing kept.

use ascend_pool::Pool;

/// Trims `pool` and checks it is valid and empty: no live region, no byte held.
pub fn assert_empty(pool: &Pool) {
    pool.trim();
    pool.validate().unwrap();
    assert!(pool.leak_report().is_empty(), "{:?}", pool.leak_report());
    for s in pool.all_stats() {
        assert_eq!((s.live_regions, s.reserved_bytes), (0, 0), "{s:?}");
    }
}
