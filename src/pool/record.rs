//! Recording a running application's allocations as a replayable trace.
//!
//! With [`PoolConfig::record`](super::PoolConfig::record) set, the pool writes one JSON line
//! per allocation and per free, in the trace format `ascend-pool replay` reads
//! (`shared/traces/README.md`):
//!
//! ```text
//! {"op":"alloc","id":1,"size":3110400,"mem":"dvpp"}
//! {"op":"alloc","id":2,"size":614400,"mem":"dvpp","align":256}
//! {"op":"free","id":1}
//! ```
//!
//! - Ids start at 1 and increase by one per allocation, so they are unique for the whole
//!   trace, not only while live.
//! - `align` is written only when it differs from the kind's default (64, 128 for DVPP).
//! - A free is written when the segment's memory goes back to its chunk: for a free that
//!   waits on streams, once they have passed it, which is when the memory became reusable;
//!   for one whose segment an allocation on the stream it waits for takes over
//!   (`alloc_*_on`), at the takeover, just before that allocation's line (work the new owner
//!   queues on the stream runs after the old).
//! - Lines are buffered and written in the order the pool saw the events of each kind (the
//!   kind's lock is held while recording), so a free always precedes the allocation that
//!   reuses its address. The buffer is flushed by [`Pool::flush_record`](super::Pool::flush_record)
//!   and when the pool's last handle (the pool or a region) is dropped.
//! - A write error does not fail the allocation that hit it: recording stops, and the error
//!   is returned by the next `flush_record`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::kind::MemKind;

/// Bytes buffered before a write reaches the file.
const BUFFER_BYTES: usize = 1 << 20;

/// Writes a pool's allocations and frees to a JSON Lines trace.
#[derive(Debug)]
pub(crate) struct Recorder {
    path: PathBuf,
    state: Mutex<RecorderState>,
}

#[derive(Debug)]
struct RecorderState {
    /// `None` once a write failed: recording has stopped.
    out: Option<BufWriter<File>>,
    /// Id of the next allocation; ids are never reused.
    next_id: u64,
    /// Trace id of every live recorded segment, by address space and start address: live
    /// segments never share a start in one space, but host memory and device memory are
    /// separate spaces on a real device, where the same number may name one of each.
    live: HashMap<(bool, usize), u64>,
    /// The first write error, kept for `flush`.
    error: Option<String>,
}

impl Recorder {
    /// Creates (or truncates) the trace file at `path`.
    pub(crate) fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).map_err(|e| Error::Io {
            op: "create",
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            path: path.to_owned(),
            state: Mutex::new(RecorderState {
                out: Some(BufWriter::with_capacity(BUFFER_BYTES, file)),
                next_id: 1,
                live: HashMap::new(),
                error: None,
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, RecorderState> {
        // A panic while writing a line leaves at worst a torn line, which the reader
        // counts as malformed: keep recording.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records an allocation of `len` bytes of `kind` at `addr` with start alignment `align`.
    pub(crate) fn alloc(&self, kind: MemKind, addr: usize, len: u64, align: u64) {
        let mut s = self.state();
        let id = s.next_id;
        s.next_id += 1;
        s.live.insert((kind == MemKind::Host, addr), id);
        let mem = kind.trace_name();
        if align == kind.default_align() {
            s.write(format_args!(
                "{{\"op\":\"alloc\",\"id\":{id},\"size\":{len},\"mem\":\"{mem}\"}}\n"
            ));
        } else {
            s.write(format_args!(
                "{{\"op\":\"alloc\",\"id\":{id},\"size\":{len},\"mem\":\"{mem}\",\"align\":{align}}}\n"
            ));
        }
    }

    /// Records the free of the segment of `kind` at `addr` (nothing when it was not
    /// recorded).
    pub(crate) fn free(&self, kind: MemKind, addr: usize) {
        let mut s = self.state();
        if let Some(id) = s.live.remove(&(kind == MemKind::Host, addr)) {
            s.write(format_args!("{{\"op\":\"free\",\"id\":{id}}}\n"));
        }
    }

    /// Writes the buffer out; the first write error since the recorder was created, if any.
    pub(crate) fn flush(&self) -> Result<()> {
        let mut s = self.state();
        if let Some(out) = s.out.as_mut() {
            if let Err(e) = out.flush() {
                s.fail(e);
            }
        }
        match &s.error {
            Some(e) => Err(Error::Io {
                op: "write",
                path: self.path.clone(),
                reason: e.clone(),
            }),
            None => Ok(()),
        }
    }
}

impl RecorderState {
    fn write(&mut self, line: std::fmt::Arguments<'_>) {
        if let Some(out) = self.out.as_mut() {
            if let Err(e) = out.write_fmt(line) {
                self.fail(e);
            }
        }
    }

    fn fail(&mut self, e: std::io::Error) {
        eprintln!("ascend-pool: recording stopped: {e}");
        self.error.get_or_insert_with(|| e.to_string());
        self.out = None;
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        // Drop cannot return the error; `fail` has already printed it.
        let _ = self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_ids_and_align() {
        let path =
            std::env::temp_dir().join(format!("ascend-pool-rec-{}.jsonl", std::process::id()));
        let r = Recorder::create(&path).unwrap();
        r.alloc(MemKind::Dvpp, 0x1000, 100, 128);
        r.alloc(MemKind::Host, 0x2000, 7, 256);
        r.alloc(MemKind::Host, 0x1000, 9, 64); // another address space: another segment
        r.free(MemKind::Dvpp, 0x1000);
        r.free(MemKind::Dvpp, 0x9999); // never recorded: nothing written
        r.free(MemKind::Dvpp, 0x2000); // recorded as host memory: not this one
        r.alloc(MemKind::Dvpp, 0x1000, 5, 128);
        r.free(MemKind::Host, 0x1000);
        r.flush().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "{\"op\":\"alloc\",\"id\":1,\"size\":100,\"mem\":\"dvpp\"}\n\
             {\"op\":\"alloc\",\"id\":2,\"size\":7,\"mem\":\"host\",\"align\":256}\n\
             {\"op\":\"alloc\",\"id\":3,\"size\":9,\"mem\":\"host\"}\n\
             {\"op\":\"free\",\"id\":1}\n\
             {\"op\":\"alloc\",\"id\":4,\"size\":5,\"mem\":\"dvpp\"}\n\
             {\"op\":\"free\",\"id\":3}\n"
        );
        drop(r);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_failed_write_stops_recording_and_is_reported_by_every_flush() {
        // Every write to /dev/full fails with ENOSPC; the 1 MiB buffer meets it on flush.
        let r = Recorder::create(Path::new("/dev/full")).unwrap();
        r.alloc(MemKind::DEVICE, 0x1000, 100, 64);
        let first = r.flush().unwrap_err();
        assert!(
            matches!(&first, Error::Io { op: "write", path, .. } if path == Path::new("/dev/full")),
            "{first}"
        );
        assert!(
            r.state().out.is_none(),
            "recording goes on after a failed write"
        );
        // Later events are dropped, and the first error stays the one reported.
        r.free(MemKind::DEVICE, 0x1000);
        assert_eq!(r.flush().unwrap_err().to_string(), first.to_string());
    }

    #[test]
    fn unwritable_path_is_an_io_error() {
        let dir = std::env::temp_dir().join("ascend-pool-no-such-dir-for-record");
        let err = Recorder::create(&dir.join("x/y.jsonl")).unwrap_err();
        assert!(
            matches!(&err, Error::Io { op: "create", path, .. } if path.ends_with("x/y.jsonl")),
            "{err}"
        );
    }
}
