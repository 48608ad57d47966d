//! What the examples share: their command-line counts and the pool's figures at the end.

use ascend_pool::{Pool, Result};

/// The positive counts on the command line, `defaults.len()` of them at most, each with its
/// default when absent. A mistyped count runs nothing rather than the defaults, so a figure is
/// never of a run other than the one asked for.
pub fn counts(usage: &str, defaults: &[u64]) -> Result<Vec<u64>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage_error = |what: String| ascend_pool::Error::Config(format!("{what}; usage: {usage}"));
    if args.len() > defaults.len() {
        return Err(usage_error(format!("{} arguments", args.len())));
    }
    defaults
        .iter()
        .enumerate()
        .map(|(i, &default)| match args.get(i) {
            None => Ok(default),
            Some(a) => a
                .parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| usage_error(format!("`{a}` is not a positive count"))),
        })
        .collect()
}

/// Prints one line per memory kind the run used: peaks, what is still reserved, allocations,
/// chunks and calls to the block source.
pub fn print_kind_table(pool: &Pool) {
    println!(
        "{:<15} {:>12} {:>12} {:>12} {:>10} {:>8} {:>10}",
        "kind", "peak alloc", "peak reserv", "reserved", "allocs", "chunks", "src calls"
    );
    for s in pool.all_stats() {
        if s.allocations == 0 {
            continue;
        }
        println!(
            "{:<15} {:>12} {:>12} {:>12} {:>10} {:>8} {:>10}",
            s.kind.to_string(),
            s.peak_allocated_bytes,
            s.peak_reserved_bytes,
            s.reserved_bytes,
            s.allocations,
            s.chunks,
            s.source_alloc_calls
        );
    }
}
