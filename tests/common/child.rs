//! Runs one test of the current test binary again in a child process, for what only a
//! process of its own shows: what it prints on stderr, or an environment every load reads.

/// Runs the test `name` of this binary alone in a child with `marker` (and `env`) set, and
/// returns the child's stdout and stderr once it has passed that one test. The test tells
/// the child by `marker`.
pub fn rerun_in_child(name: &str, marker: &str, env: &[(&str, &str)]) -> (String, String) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads=1", "--nocapture"])
        .env(marker, "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("1 passed"),
        "the child ran no test: {stdout}"
    );
    (stdout, stderr)
}
