//! Streams with a worker thread each, and events recorded on them.
//!
//! A stream is a FIFO of [`Op`]s run one at a time by its own thread. An event numbers its
//! records: `recorded` is the sequence number of the most recent `aclrtRecordEvent`, and
//! each record is passed on its own, when the stream it was queued on gets there. The event
//! is complete when its most recent record has been passed (so an event never recorded is
//! complete); a wait queued for an earlier record waits for that record, even when a later
//! one on a faster stream has been passed already.
//!
//! A [`Notify`] is HCCL's notification between ranks: a record lets one wait through. A wait
//! that times out fails its stream's task, and the stream's next synchronize reports it.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::comm::{Inbound, NotifyHome};
use super::mapping::{copy_bytes, fill_bytes, Mapping};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Worker code does not panic while holding these locks; if a test thread did, the
    // counters are still consistent, so keep going.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Work queued on a stream.
pub(super) enum Op {
    /// Holds the stream busy, as a kernel would.
    Delay(Duration),
    /// Copies `count` bytes from `src` to `dst`, taking `cost` of simulated time first.
    Copy {
        dst: usize,
        src: usize,
        count: usize,
        cost: Duration,
        /// The simulator blocks the copy touches, kept mapped until it has run (but a
        /// one-sided write's window, which `inbound` guards instead).
        keep: Vec<Arc<Mapping>>,
        /// A one-sided write's window: the bytes land only while it is registered.
        inbound: Option<Inbound>,
    },
    /// Fills `count` bytes at `dst` with `value`, taking `cost` first.
    Fill {
        dst: usize,
        value: u8,
        count: usize,
        cost: Duration,
        keep: Vec<Arc<Mapping>>,
    },
    /// Marks record number `seq` of `event` as passed.
    Record { event: Arc<Event>, seq: u64 },
    /// Waits until record number `seq` of `event` has been passed.
    Wait { event: Arc<Event>, seq: u64 },
    /// Waits until the gate is opened.
    Gate(Arc<Gate>),
    /// Lets one wait on `notify` through (`HcommChannelNotifyRecordOnThread`).
    NotifyRecord(Arc<Notify>),
    /// Waits until `notify` has been recorded, and takes that record
    /// (`HcommChannelNotifyWaitOnThread`); gives up after `timeout` (`None`: never), or
    /// once the stream is closing.
    NotifyWait {
        notify: Arc<Notify>,
        timeout: Option<Duration>,
    },
}

/// How long a notification wait sleeps between looks at whether its stream is closing.
const WAIT_SLICE: Duration = Duration::from_millis(20);

impl Op {
    /// Runs the op on `shared`'s worker; `false` when the task failed.
    fn run(self, shared: &StreamShared) -> bool {
        match self {
            Op::Delay(d) => sleep(d),
            Op::Copy {
                dst,
                src,
                count,
                cost,
                keep,
                inbound,
            } => {
                sleep(cost);
                // SAFETY: the simulator checked at enqueue time that every device-side range
                // lies inside a live block, and `keep` holds those blocks mapped until now,
                // but a window's: that write runs only while its window is registered (under
                // `land`), and the memory under a window is freed or unmapped only after the
                // window is closed; host-side ranges are valid by the `memcpy_async` contract
                // the caller accepted.
                let copy = || unsafe { copy_bytes(dst, src, count) };
                let landed = match &inbound {
                    Some(window) => window.land(copy),
                    None => {
                        copy();
                        true
                    }
                };
                drop(keep);
                return landed;
            }
            Op::Fill {
                dst,
                value,
                count,
                cost,
                keep,
            } => {
                sleep(cost);
                // SAFETY: the range was checked to lie inside a live block at enqueue time,
                // and `keep` holds that block mapped until now.
                unsafe { fill_bytes(dst, value, count) };
                drop(keep);
            }
            Op::Record { event, seq } => event.complete(seq),
            Op::Wait { event, seq } => event.wait_for(seq),
            Op::Gate(gate) => gate.wait(),
            Op::NotifyRecord(notify) => {
                notify.record();
                notify.done();
            }
            Op::NotifyWait { notify, timeout } => {
                let deadline = timeout.map(|t| Instant::now() + t);
                let ok = notify.wait(deadline, || lock(&shared.queue).closing);
                notify.done();
                return ok;
            }
        }
        true
    }
}

/// A notification: records not yet waited for. A record lets exactly one wait through.
#[derive(Debug)]
pub(super) struct Notify {
    records: Mutex<u64>,
    cv: Condvar,
    /// Where the communicator keeps it, for the last op done with it to forget it.
    home: NotifyHome,
}

impl Notify {
    /// A notification with no record, kept at `home`.
    pub(super) fn new(home: NotifyHome) -> Self {
        Self {
            records: Mutex::new(0),
            cv: Condvar::new(),
            home,
        }
    }

    /// An op's hold on it ends: once idle, it is forgotten if no channel joins its ranks
    /// (a release while the op held it kept it, and may have been the last one).
    fn done(self: Arc<Self>) {
        let home = self.home.clone();
        // Let go first: the look that follows counts the holds left.
        drop(self);
        home.forget_idle();
    }

    /// Whether a queued op holds it (a [`Notify`] is shared through an `Arc`, the map's
    /// one aside) or a record waits to be taken: forgetting it then would lose an order.
    pub(super) fn in_use(self: &Arc<Self>) -> bool {
        Arc::strong_count(self) > 1 || *lock(&self.records) > 0
    }

    fn record(&self) {
        *lock(&self.records) += 1;
        self.cv.notify_all();
    }

    /// Takes one record, waiting for it until `deadline` (`None`: for ever) or until
    /// `give_up` says so; `false` when none came.
    fn wait(&self, deadline: Option<Instant>, give_up: impl Fn() -> bool) -> bool {
        let mut records = lock(&self.records);
        loop {
            if *records > 0 {
                *records -= 1;
                return true;
            }
            let now = Instant::now();
            let slice = match deadline {
                Some(d) if d <= now => return false,
                Some(d) => (d - now).min(WAIT_SLICE),
                None => WAIT_SLICE,
            };
            records = self
                .cv
                .wait_timeout(records, slice)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            if *records == 0 && give_up() {
                return false;
            }
        }
    }
}

fn sleep(d: Duration) {
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

/// The queue a stream's worker drains.
///
/// Invariant: `completed + ops.len() + (1 if an op is running) == enqueued`.
#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    /// Ops ever pushed.
    enqueued: u64,
    /// Ops the worker has finished.
    completed: u64,
    /// No more ops will come: the worker exits once `ops` is empty.
    closing: bool,
    /// A task failed (a notification wait timed out) since the last [`Stream::take_fault`].
    faulted: bool,
}

#[derive(Default)]
struct StreamShared {
    queue: Mutex<Queue>,
    /// Signalled when an op is pushed, an op completes, or the stream closes.
    cv: Condvar,
}

/// A simulated `aclrtStream`: a queue and the thread that runs it.
pub(super) struct Stream {
    device: i32,
    shared: Arc<StreamShared>,
    /// Taken by the first `close`.
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = lock(&self.shared.queue);
        f.debug_struct("Stream")
            .field("device", &self.device)
            .field("enqueued", &q.enqueued)
            .field("completed", &q.completed)
            .finish()
    }
}

impl Stream {
    /// Starts a stream with its worker thread.
    pub(super) fn spawn(id: usize, device: i32) -> std::io::Result<Self> {
        let shared = Arc::new(StreamShared::default());
        let theirs = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name(format!("acl-sim-stream-{id}"))
            .spawn(move || worker_loop(&theirs))?;
        Ok(Self {
            device,
            shared,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// The device the stream was created on.
    pub(super) fn device(&self) -> i32 {
        self.device
    }

    /// Queues the op `make` builds behind everything already queued.
    ///
    /// `make` runs under the queue lock, only when the stream still takes work, so a
    /// record number it draws is always followed by its `Record` op. Returns `false`
    /// (and does not call `make`) once the stream is closing.
    pub(super) fn push_with(&self, make: impl FnOnce() -> Op) -> bool {
        let mut q = lock(&self.shared.queue);
        if q.closing {
            return false;
        }
        q.ops.push_back(make());
        q.enqueued += 1;
        self.shared.cv.notify_all();
        true
    }

    /// Queues `op`; `false` once the stream is closing.
    pub(super) fn push(&self, op: Op) -> bool {
        self.push_with(|| op)
    }

    /// Blocks until every op queued before this call has run.
    pub(super) fn synchronize(&self) {
        let mut q = lock(&self.shared.queue);
        let target = q.enqueued;
        while q.completed < target {
            q = self
                .shared
                .cv
                .wait(q)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Whether a task failed since the last call, which clears it: the runtime reports a
    /// failed task once, to the synchronize after it.
    pub(super) fn take_fault(&self) -> bool {
        std::mem::take(&mut lock(&self.shared.queue).faulted)
    }

    /// Ops queued or running.
    pub(super) fn pending(&self) -> u64 {
        let q = lock(&self.shared.queue);
        q.enqueued - q.completed
    }

    /// Refuses new work and tells waits that may give up to do so; does not wait.
    pub(super) fn begin_close(&self) {
        let mut q = lock(&self.shared.queue);
        q.closing = true;
        self.shared.cv.notify_all();
    }

    /// Refuses new work, lets the worker drain the queue, then joins it. Idempotent.
    pub(super) fn close(&self) {
        self.begin_close();
        let worker = lock(&self.worker).take();
        if let Some(worker) = worker {
            // The worker never panics on its own; a join error would only relay a panic
            // we cannot act on during teardown.
            let _ = worker.join();
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.close();
    }
}

fn worker_loop(shared: &StreamShared) {
    loop {
        let op = {
            let mut q = lock(&shared.queue);
            loop {
                if let Some(op) = q.ops.pop_front() {
                    break op;
                }
                if q.closing {
                    return;
                }
                q = shared.cv.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let ok = op.run(shared);
        let mut q = lock(&shared.queue);
        q.faulted |= !ok;
        q.completed += 1;
        shared.cv.notify_all();
    }
}

/// A barrier a stream waits at until the host opens it.
#[derive(Debug, Default)]
pub(super) struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    /// Lets the waiting stream go on (idempotent).
    pub(super) fn open(&self) {
        *lock(&self.open) = true;
        self.cv.notify_all();
    }

    fn wait(&self) {
        let mut open = lock(&self.open);
        while !*open {
            open = self.cv.wait(open).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Records of an event and which of them have been passed.
///
/// Invariant: `passed_upto <= recorded`; every number in `passed_above` lies in
/// `passed_upto + 2..=recorded` (the one after `passed_upto` would have been folded in).
#[derive(Debug, Default)]
struct EventState {
    /// Sequence number of the most recent record (0: never recorded).
    recorded: u64,
    /// Every record up to this one has been passed.
    passed_upto: u64,
    /// Records passed out of order (queued on different streams), above `passed_upto`.
    passed_above: std::collections::BTreeSet<u64>,
}

impl EventState {
    fn passed(&self, seq: u64) -> bool {
        seq <= self.passed_upto || self.passed_above.contains(&seq)
    }
}

/// A simulated `aclrtEvent`.
#[derive(Debug)]
pub(super) struct Event {
    device: i32,
    state: Mutex<EventState>,
    /// Signalled whenever a record is passed.
    cv: Condvar,
}

impl Event {
    pub(super) fn new(device: i32) -> Self {
        Self {
            device,
            state: Mutex::new(EventState::default()),
            cv: Condvar::new(),
        }
    }

    /// The device the event was created on.
    pub(super) fn device(&self) -> i32 {
        self.device
    }

    /// Starts a new record and returns its sequence number.
    pub(super) fn next_record(&self) -> u64 {
        let mut s = lock(&self.state);
        s.recorded += 1;
        s.recorded
    }

    /// The sequence number of the most recent record (0 when never recorded).
    pub(super) fn last_record(&self) -> u64 {
        lock(&self.state).recorded
    }

    /// Whether the most recent record has been passed.
    pub(super) fn is_complete(&self) -> bool {
        let s = lock(&self.state);
        s.passed(s.recorded)
    }

    /// Blocks until the most recent record (as of this call) has been passed.
    pub(super) fn synchronize(&self) {
        let target = self.last_record();
        self.wait_for(target);
    }

    fn complete(&self, seq: u64) {
        let mut s = lock(&self.state);
        debug_assert!(seq <= s.recorded && !s.passed(seq));
        if s.passed(seq) {
            return;
        }
        s.passed_above.insert(seq);
        while let Some(next) = s.passed_upto.checked_add(1) {
            if !s.passed_above.remove(&next) {
                break;
            }
            s.passed_upto = next;
        }
        self.cv.notify_all();
    }

    /// Blocks until record `seq` itself has been passed.
    fn wait_for(&self, seq: u64) {
        let mut s = lock(&self.state);
        while !s.passed(seq) {
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn ops_run_in_order_and_sync_waits() {
        let s = Stream::spawn(1, 0).unwrap();
        let e = Arc::new(Event::new(0));
        assert!(e.is_complete(), "never recorded counts as complete");
        assert!(s.push(Op::Delay(Duration::from_millis(50))));
        let gate = Arc::new(Gate::default());
        assert!(s.push(Op::Gate(Arc::clone(&gate))));
        assert!(s.push_with(|| Op::Record {
            event: Arc::clone(&e),
            seq: e.next_record(),
        }));
        assert!(!e.is_complete());
        assert!(s.pending() >= 2);
        gate.open();
        e.synchronize();
        assert!(e.is_complete());
        s.synchronize();
        assert_eq!(s.pending(), 0);
        s.close();
        assert!(
            !s.push(Op::Delay(Duration::ZERO)),
            "closed streams take no work"
        );
    }

    #[test]
    fn wait_orders_two_streams() {
        let a = Stream::spawn(1, 0).unwrap();
        let b = Stream::spawn(2, 0).unwrap();
        let e = Arc::new(Event::new(0));
        let t0 = Instant::now();
        assert!(a.push(Op::Delay(Duration::from_millis(80))));
        let seq = e.next_record();
        assert!(a.push(Op::Record {
            event: Arc::clone(&e),
            seq,
        }));
        assert!(b.push(Op::Wait {
            event: Arc::clone(&e),
            seq,
        }));
        b.synchronize();
        assert!(t0.elapsed() >= Duration::from_millis(80));
        assert!(e.is_complete());
        drop(a);
        drop(b);
    }

    /// An event recorded on a held stream, then again on a free one: a wait queued for
    /// the first record waits for it, though the second (later) record has been passed.
    #[test]
    fn a_wait_is_for_its_own_record_not_a_later_one() {
        let (slow, fast, waiter) = (
            Stream::spawn(1, 0).unwrap(),
            Stream::spawn(2, 0).unwrap(),
            Stream::spawn(3, 0).unwrap(),
        );
        let e = Arc::new(Event::new(0));
        let gate = Arc::new(Gate::default());
        assert!(slow.push(Op::Gate(Arc::clone(&gate))));
        let first = e.next_record();
        assert!(slow.push(Op::Record {
            event: Arc::clone(&e),
            seq: first,
        }));
        assert!(waiter.push(Op::Wait {
            event: Arc::clone(&e),
            seq: first,
        }));
        let second = e.next_record();
        assert!(fast.push(Op::Record {
            event: Arc::clone(&e),
            seq: second,
        }));
        fast.synchronize();
        assert!(e.is_complete(), "the most recent record was passed");
        std::thread::sleep(Duration::from_millis(30));
        let still_waiting = waiter.pending() == 1;
        gate.open(); // before any assertion: a held stream never joins
        assert!(still_waiting, "the wait let go before its record ran");
        waiter.synchronize();
        slow.synchronize();
        let s = lock(&e.state);
        assert_eq!((s.passed_upto, s.passed_above.len()), (2, 0));
    }
}
