//! What a refusal of the runtime (or of the simulator standing in for it) says.

use ascend_pool::Error;

/// The function and code of an [`Error::Runtime`]; any other error fails the test.
pub fn refusal(e: Error) -> (&'static str, i32) {
    match e {
        Error::Runtime { func, code } => (func, code.0),
        other => panic!("expected a runtime error, got {other:?}"),
    }
}
