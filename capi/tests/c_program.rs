//! Builds `tests/c/pipeline.c` against `include/ascend_pool.h` and the crate's
//! `libascend_pool_capi.so` with the system C compiler, then runs it on the simulator and, as
//! an AscendCL program would run on a device, over the drop-in `libascendcl.so`. Builds
//! `tests/c/share.c` and runs it as two processes sharing device memory. The header is also
//! compiled as C++. Under `.ci/sanitize.sh` every program is built with the sanitizer, and
//! `tests/c/sanitizer_probe.c` proves its reports fail the suite.

#[path = "../../tests/common/dropin.rs"]
mod common_dropin;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, OnceLock};
use std::time::Duration;

/// The directory cargo put this test in: the crate's cdylib is built beside it.
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.parent().expect("a deps directory").to_path_buf()
}

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../include")
}

/// The sanitizer `.ci/sanitize.sh` runs these tests under, and the runtime archive to link
/// into the C programs (the one rustc links into its own sanitized executables).
///
/// The library this suite loads is then instrumented and calls into that runtime, which only
/// an executable can carry: so each C program is compiled with the same sanitizer and linked
/// with the archive, exporting its symbols for the library (and the drop-in it loads).
fn sanitizer() -> Option<(String, PathBuf)> {
    let kind = std::env::var("ASCEND_POOL_C_SANITIZER").ok()?;
    let runtime = std::env::var_os("ASCEND_POOL_C_SANITIZER_RT")
        .map(PathBuf::from)
        .expect("ASCEND_POOL_C_SANITIZER needs ASCEND_POOL_C_SANITIZER_RT, the runtime archive");
    assert!(
        matches!(kind.as_str(), "address" | "thread") && runtime.is_file(),
        "sanitizer {kind:?} with runtime {}",
        runtime.display()
    );
    Some((kind, runtime))
}

/// Compiles C `source` into `exe` against the header and the crate's library, with every
/// warning an error; under [`sanitizer`], instrumented and linked with its runtime.
fn compile(source: &Path, exe: &Path) {
    let deps = deps_dir();
    assert!(
        deps.join("libascend_pool_capi.so").is_file(),
        "libascend_pool_capi.so is not in {}",
        deps.display()
    );
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(include_dir());
    let sanitizer = sanitizer();
    let input = match &sanitizer {
        None => source.to_path_buf(),
        Some((kind, _)) => {
            // Compiled apart: linking with `-fsanitize` would bring the C compiler's runtime,
            // a second one beside the library's.
            let object = exe.with_extension("o");
            cc.arg(format!("-fsanitize={kind}"))
                .args(["-g", "-fno-omit-frame-pointer", "-c", "-o"])
                .arg(&object)
                .arg(source);
            run_cc(cc, source);
            cc = Command::new("cc");
            object
        }
    };
    cc.arg(input);
    cc.arg("-L")
        .arg(&deps)
        .arg("-lascend_pool_capi")
        .arg(format!("-Wl,-rpath,{}", deps.display()));
    if let Some((_, runtime)) = &sanitizer {
        cc.arg("-Wl,--whole-archive")
            .arg(runtime)
            .args(["-Wl,--no-whole-archive", "-Wl,--export-dynamic"])
            .args(["-lpthread", "-ldl", "-lm", "-lrt"]);
    }
    cc.arg("-o").arg(exe);
    run_cc(cc, source);
}

/// Runs the C compiler on `source`'s behalf; it must succeed.
fn run_cc(mut cc: Command, source: &Path) {
    let out = cc.output().expect("run the C compiler (cc)");
    assert!(
        out.status.success(),
        "{} does not compile:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `tests/c/NAME.c`, compiled once per test binary.
fn built(name: &str, cell: &'static OnceLock<PathBuf>) -> &'static Path {
    cell.get_or_init(|| {
        let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("capi-{name}"));
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
        compile(&source, &exe);
        exe
    })
}

/// A program, finding the library cargo just built: `cargo test` puts `target/debug` on
/// the loader path, where `cargo build` may have left an older copy that would win over the
/// program's run path.
fn command_for(exe: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.env("LD_LIBRARY_PATH", deps_dir())
        .env_remove("ASCEND_POOL_CONF");
    cmd
}

/// Runs `cmd`, the program `name`, which must exit 0 having printed "ok" and nothing on
/// stderr.
fn passes(name: &str, mut cmd: Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("run the {name} program: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} failed ({}):\n{stderr}",
        out.status
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
    assert!(stderr.is_empty(), "{name}:\n{stderr}");
}

/// The pipeline program.
fn command() -> Command {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    command_for(built("pipeline", &EXE))
}

fn run(args: &[&str], env: &[(&str, &Path)]) -> String {
    let mut cmd = command();
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the pipeline");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "pipeline {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status,
    );
    // Nothing to say: no leak report when the pools are destroyed.
    assert!(stderr.is_empty(), "pipeline {args:?}:\n{stderr}");
    stdout
}

/// `key=value` from the program's report line.
fn field(report: &str, key: &str) -> u64 {
    report
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key} in {report:?}"))
        .parse()
        .unwrap()
}

fn check(report: &str) {
    assert!(report.starts_with("ok "), "{report}");
    assert_eq!(field(report, "frames"), 48);
    // Stream-ordered frees: every frame's decoder input lands where the first one did, and
    // one DVPP chunk serves them all.
    assert_eq!(field(report, "dvpp_reused"), 48, "{report}");
    assert_eq!(field(report, "dvpp_source_allocs"), 1, "{report}");
    // The host staging buffer is the one region left when the pool is destroyed.
    assert_eq!(field(report, "freed_at_destroy"), 1, "{report}");
}

#[test]
fn a_c_pipeline_runs_on_the_simulator() {
    check(&run(&["sim", "48"], &[]));
}

#[test]
fn a_c_pipeline_runs_over_the_dropin_libascendcl() {
    let lib = common_dropin::dropin();
    check(&run(&["acl", "48"], &[("ASCEND_POOL_ACL_LIB", lib)]));
}

#[test]
fn one_sided_writes_from_c_over_the_dropin_libascendcl() {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let mut cmd = command_for(built("onesided", &EXE));
    cmd.env("ASCEND_POOL_ACL_LIB", common_dropin::dropin());
    passes("onesided", cmd);
}

/// Children made by `fork` while two threads are inside calls on the parent's pools
/// (`tests/c/fork.c`): the parent's handles answer `AP_ERR_FORKED`, destroying the parent's
/// pool neither hangs on a call the fork cut short nor frees anything, the child's own pools
/// work (memory it publishes and opens again too, through a runtime of its own), and the
/// parent's pool is as it was. Before the fork handlers, children hung on locks
/// a parent thread held at the fork (some of the 24 in every run).
#[test]
fn forked_children_refuse_the_parents_handles_and_make_pools_of_their_own() {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    passes("fork", command_for(built("fork", &EXE)));
}

#[test]
fn a_missing_libascendcl_is_a_status_not_a_crash() {
    let out = command()
        .args(["acl", "1"])
        .env("ASCEND_POOL_ACL_LIB", "/nonexistent/libascendcl.so")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("want AP_OK") && err.contains("AP_ERR_LIBRARY_LOAD"),
        "{err}"
    );
    assert!(err.contains("/nonexistent/libascendcl.so"), "{err}");
}

#[test]
fn the_header_compiles_as_cpp() {
    let out = Command::new("c++")
        .args([
            "-std=c++17",
            "-fsyntax-only",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-x",
            "c++",
        ])
        .arg(include_dir().join("ascend_pool.h"))
        .output()
        .expect("run the C++ compiler (c++)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The README's C example, inside a `main`, compiles against the header and runs.
#[test]
fn the_readme_example_compiles_and_runs() {
    let readme = include_str!("../../README.md");
    let start = readme.find("```c\n").expect("a C example in the README") + 5;
    let body = &readme[start..start + readme[start..].find("```").unwrap()];
    let source = Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme-example.c");
    std::fs::write(
        &source,
        format!(
            "#include \"ascend_pool.h\"\nint main(void) {{\n    uint64_t frame_len = 3110400;\n\
             {body}    return ap_pool_destroy(pool, 0) == AP_OK ? 0 : 1;\n}}\n"
        ),
    )
    .unwrap();
    let exe = source.with_extension("");
    compile(&source, &exe);
    let run = command_for(&exe).output().unwrap();
    assert!(
        run.status.success() && run.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// One process of `share.c`: its stdin, and its stdout's lines as a thread reads them (a
/// process that stops talking fails the test instead of hanging it).
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn spawn(role: &str, runtime: &str, env: &[(&str, &Path)]) -> Peer {
        static EXE: OnceLock<PathBuf> = OnceLock::new();
        let mut cmd = command_for(built("share", &EXE));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .args([role, runtime])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start share");
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Peer { child, lines }
    }

    /// The next line, which must start with `key`.
    fn line(&mut self, key: &str, other: &mut Peer) -> String {
        match self.lines.recv_timeout(Duration::from_secs(120)) {
            Ok(l) if l.starts_with(key) => l,
            got => {
                let _ = other.child.kill();
                let _ = self.child.kill();
                let err = stderr_of(&mut self.child) + &stderr_of(&mut other.child);
                panic!("wanted {key:?}, got {got:?}; stderr:\n{err}")
            }
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Its exit status (it must succeed) and its stderr (it must be empty).
    fn finish(mut self) {
        let status = self.child.wait().unwrap();
        let err = stderr_of(&mut self.child);
        assert!(status.success() && err.is_empty(), "{status}:\n{err}");
    }
}

/// What an ended (or killed) process wrote on stderr.
fn stderr_of(child: &mut Child) -> String {
    use std::io::Read;
    let _ = child.wait();
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    err
}

/// The two processes of `share.c` over `runtime`, passing each other's lines.
fn share(runtime: &str, env: &[(&str, &Path)]) {
    let mut importer = Peer::spawn("import", runtime, env);
    let mut exporter = Peer::spawn("export", runtime, env);
    let id = importer.line("id ", &mut exporter);
    exporter.send(&id);
    let desc = exporter.line("desc {", &mut importer);
    importer.send(&desc);
    let refused = exporter.line("refused {", &mut importer);
    importer.send(&refused);
    let mbuf = exporter.line("mbuf {", &mut importer);
    importer.send(&mbuf);
    // The importer's count of failed checks: none.
    let done = importer.line("done 0", &mut exporter);
    exporter.send(&done);
    importer.line("ok importer", &mut exporter);
    exporter.line("ok exporter", &mut importer);
    importer.finish();
    exporter.finish();
}

#[test]
fn two_c_processes_share_device_memory() {
    share("sim", &[]);
}

#[test]
fn two_c_processes_share_device_memory_over_the_dropin_libascendcl() {
    share("acl", &[("ASCEND_POOL_ACL_LIB", common_dropin::dropin())]);
}

/// Under `.ci/sanitize.sh`, the sanitizer is live in the C programs this suite runs: a
/// library write past the end of a caller's buffer (AddressSanitizer) or a race between
/// two of a program's threads (ThreadSanitizer) is reported and fails the program. Without a
/// sanitizer there is nothing to prove.
#[test]
fn the_sanitizer_reports_bugs_in_the_c_programs() {
    let Some((kind, _)) = sanitizer() else {
        return;
    };
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    let (arg, report) = match kind.as_str() {
        "address" => ("library", "ERROR: AddressSanitizer: heap-buffer-overflow"),
        _ => ("race", "WARNING: ThreadSanitizer: data race"),
    };
    let out = command_for(built("sanitizer_probe", &EXE))
        .arg(arg)
        .output()
        .expect("run the probe");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(report),
        "{kind}: {}\n{err}",
        out.status
    );
    if arg == "library" {
        // The write is reported where the library made it.
        assert!(err.contains("ap_last_error"), "{err}");
    }
}
