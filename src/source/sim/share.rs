//! Shareable handles between real processes.
//!
//! A process that exports physical memory starts (once) a service thread listening on the
//! abstract unix socket `ascend-pool-sim.<pid>.<instance>`: abstract names vanish with the
//! process, so nothing is left in the file system. The instance tells apart the copies of
//! the simulator one process may hold (the library itself, and a drop-in `libascendcl.so`
//! loaded beside it). A shareable handle is `pid << 42 | instance << 32 | serial`. To import
//! it, a process connects to the exporter's socket and asks for the handle; the exporter
//! reads the importer's process id from the kernel (`SO_PEERCRED`, which a process cannot
//! forge), checks it against the handle's whitelist, and passes the memory object's
//! descriptor back (`SCM_RIGHTS`). The connection then stays open as long as the importer
//! holds the memory: its end (a free, or the importer's exit) tells the exporter, which keeps
//! the memory charged to its device until the last importer has let go. The memory itself
//! lives as long as any process maps it or holds its descriptor.
//!
//! One departure from the runtime, on purpose: the runtime imports only across processes,
//! but the simulator also lets a process import what it exported itself, so that tests and
//! examples can play exporter and importer in one process. Code meant for hardware should
//! import in another process.
//!
//! # Error codes
//!
//! | situation | code |
//! |---|---|
//! | a handle no process exports (never exported, freed by its exporter, or the exporter is gone) | `ACL_ERROR_RT_INVALID_HANDLE` (107017) |
//! | exporting a handle twice, or exporting imported memory; importing a handle this process holds imported already (the runtime maps handles one to one within a process) | `ACL_ERROR_RT_PARAM_INVALID` (107000) |
//! | importing from a process whose whitelist does not name this process (the simulator's choice: the driver refuses) | `ACL_ERROR_DRV_FAILURE` (500004) |
//! | the service thread or the exchange with the exporter fails | `ACL_ERROR_RT_FAILURE` (500003) |

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::error::AclError;

/// What runs when the last importer of memory its exporter freed lets go.
pub(super) type Release = Box<dyn FnOnce() + Send>;

/// Code a process off the whitelist gets from `aclrtMemImportFromShareableHandle` (the
/// simulator's choice; the runtime documents none).
pub const NOT_WHITELISTED: AclError = AclError::DRV_FAILURE;

/// How long either side waits for the other during an import.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);

/// One exported allocation.
struct Export {
    /// The memory object, while the exporter holds it (`None` once it freed it).
    fd: Option<OwnedFd>,
    size: u64,
    validate_pid: bool,
    whitelist: Vec<i32>,
    /// Importers that still hold the memory.
    importers: u32,
    /// Set when the exporter freed the memory while importers held it.
    release: Option<Release>,
}

/// Exports of this process by shareable handle.
///
/// Invariant: an entry lives while its exporter holds the memory (`fd` is some) or an
/// importer does (`importers > 0`); it is removed, and `release` run, when neither does.
static EXPORTS: LazyLock<Mutex<HashMap<u64, Export>>> = LazyLock::new(Default::default);
static NEXT_SERIAL: AtomicU32 = AtomicU32::new(1);
/// The instance number of this copy's service once started, and its listening socket, with
/// the process it runs in: a child made by `fork` does not have its parent's service thread,
/// and starts its own.
static SERVICE: Mutex<Option<(u32, Service)>> = Mutex::new(None);
/// A started service's instance and listening socket, or why it could not start.
type Service = Result<(u32, RawFd), AclError>;
/// Service instances one process may run.
const INSTANCES: u32 = 1 << 10;

fn exports() -> MutexGuard<'static, HashMap<u64, Export>> {
    // Entries are updated in one step each; a panic elsewhere leaves them consistent.
    EXPORTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// This process's service instance, started on first use.
fn service() -> Result<u32, AclError> {
    let pid = std::process::id();
    let mut service = SERVICE.lock().unwrap_or_else(PoisonError::into_inner);
    match *service {
        Some((started_in, started)) if started_in == pid => started.map(|(i, _)| i),
        _ => {
            let started = start_service();
            *service = Some((pid, started));
            started.map(|(i, _)| i)
        }
    }
}

thread_local! {
    /// The locks [`hold_for_fork`] took, for the same thread to let go after the fork.
    static HELD_FOR_FORK: RefCell<Option<ForkGuards>> = const { RefCell::new(None) };
}

type ForkGuards = (
    MutexGuard<'static, Option<(u32, Service)>>,
    MutexGuard<'static, HashMap<u64, Export>>,
    MutexGuard<'static, HashMap<u64, Imported>>,
);

/// Takes the service, export and import locks just before a fork, so that the child does
/// not inherit one held by a thread it does not have. Each is held alone elsewhere (never
/// while waiting for another), so taking all three cannot deadlock.
pub(crate) fn hold_for_fork() {
    let guards = (
        SERVICE.lock().unwrap_or_else(PoisonError::into_inner),
        exports(),
        imported(),
    );
    // A fork from a thread whose thread-locals are gone: the locks go back at once.
    let _ = HELD_FOR_FORK.try_with(|h| *h.borrow_mut() = Some(guards));
}

/// Lets go of the locks [`hold_for_fork`] took; in a child, first forgets the parent's
/// exports: the child serves only what it exports itself (its service is its own too,
/// started by process id).
pub(crate) fn release_after_fork(in_child: bool) {
    let _ = HELD_FOR_FORK.try_with(|h| {
        let Some((service, mut exports, mut imported)) = h.borrow_mut().take() else {
            return;
        };
        if in_child {
            // SAFETY: a NUL-terminated path; `open` and `dup2` are safe after a fork.
            let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            // The parent's listening socket: its copy here would keep the parent's name bound
            // after the parent exits, and an import of the parent's handles would then wait
            // for an answer no thread gives (rather than find no listener: the handle is
            // gone). /dev/null takes its place, as for the links below.
            if let (Some((_, Ok((_, listener)))), true) = (&*service, null >= 0) {
                // SAFETY: `listener` is this process's copy of the parent's listening socket,
                // which nothing in this process closes (its thread is the parent's).
                unsafe { libc::dup2(null, *listener) };
            }
            for (_, e) in exports.drain() {
                // The child's copy of the descriptor is closed, so that the memory does not
                // outlive its parent's hold on it; what runs when the parent's importers
                // let go is the parent's business.
                drop(e.fd);
                std::mem::forget(e.release);
            }
            // The child holds none of its parent's imports. Its copies of their links would
            // keep each exporter charged while the child lives: /dev/null takes their
            // place (the descriptors stay valid, for whatever closes them later; closing
            // or shutting the socket would cut the parent's link too).
            for (_, i) in imported.drain() {
                if let (Some(fd), true) = (i.link, null >= 0) {
                    // SAFETY: `fd` is this process's copy of the link, open until the parent's
                    // import is let go, which the child never does.
                    unsafe { libc::dup2(null, fd) };
                }
            }
            if null >= 0 {
                // SAFETY: the descriptor opened above, used by no one else.
                unsafe { libc::close(null) };
            }
        }
    });
}

fn socket_addr(pid: u32, instance: u32) -> io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("ascend-pool-sim.{pid}.{instance}").as_bytes())
}

/// Registers `fd` (`size` bytes) for export; returns the shareable handle.
pub(super) fn export(fd: OwnedFd, size: u64, validate_pid: bool) -> Result<u64, AclError> {
    let instance = service()?;
    let serial = loop {
        let s = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
        if s != 0 {
            break s;
        }
    };
    let pid = u64::from(std::process::id());
    let handle = (pid << 42) | (u64::from(instance) << 32) | u64::from(serial);
    exports().insert(
        handle,
        Export {
            fd: Some(fd),
            size,
            validate_pid,
            whitelist: Vec::new(),
            importers: 0,
            release: None,
        },
    );
    Ok(handle)
}

/// Adds `pids` to the whitelist of a handle this process exports and still holds.
pub(super) fn allow(handle: u64, pids: &[i32]) -> Result<(), AclError> {
    let mut ex = exports();
    let e = ex
        .get_mut(&handle)
        .filter(|e| e.fd.is_some())
        .ok_or(AclError::RT_INVALID_HANDLE)?;
    // A set: a process let in again (each publish of a region of the same allocation)
    // adds nothing, or the list would grow for as long as the memory is exported.
    for &pid in pids {
        if !e.whitelist.contains(&pid) {
            e.whitelist.push(pid);
        }
    }
    Ok(())
}

/// The exporter freed the memory: no new import. `Ok` when importers still hold it (the
/// last one runs `release`), `Err(release)` when no one does (the caller releases now).
pub(super) fn close_export(handle: u64, release: Release) -> Result<(), Release> {
    let mut ex = exports();
    let Some(e) = ex.get_mut(&handle) else {
        return Err(release);
    };
    e.fd = None;
    if e.importers == 0 {
        ex.remove(&handle);
        return Err(release);
    }
    e.release = Some(release);
    Ok(())
}

fn importer_left(handle: u64) {
    let release = {
        let mut ex = exports();
        let Some(e) = ex.get_mut(&handle) else {
            return;
        };
        e.importers -= 1;
        if e.importers == 0 && e.fd.is_none() {
            ex.remove(&handle).and_then(|e| e.release)
        } else {
            None
        }
    };
    if let Some(release) = release {
        release();
    }
}

fn start_service() -> Service {
    // pid_max is at most 2^22, so a process id fits the handle's 22 bits.
    if std::process::id() >= 1 << 22 {
        return Err(AclError::RT_FAILURE);
    }
    let (instance, listener) = (0..INSTANCES)
        .find_map(|i| {
            let addr = socket_addr(std::process::id(), i).ok()?;
            UnixListener::bind_addr(&addr).ok().map(|l| (i, l))
        })
        .ok_or(AclError::RT_FAILURE)?;
    let fd = listener.as_raw_fd();
    std::thread::Builder::new()
        .name("acl-sim-share".into())
        .stack_size(128 << 10)
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                answer(conn);
            }
        })
        .map_err(|_| AclError::RT_FAILURE)?;
    Ok((instance, fd))
}

/// Serves one import request.
fn answer(mut conn: UnixStream) {
    let _ = conn.set_read_timeout(Some(EXCHANGE_TIMEOUT));
    let _ = conn.set_write_timeout(Some(EXCHANGE_TIMEOUT));
    let mut request = [0u8; 8];
    if conn.read_exact(&mut request).is_err() {
        return;
    }
    let handle = u64::from_le_bytes(request);
    let peer = peer_pid(&conn);
    let granted = {
        let mut ex = exports();
        match ex.get_mut(&handle) {
            None | Some(Export { fd: None, .. }) => Err(AclError::RT_INVALID_HANDLE),
            Some(e) if e.validate_pid && !peer.is_some_and(|p| e.whitelist.contains(&p)) => {
                Err(NOT_WHITELISTED)
            }
            Some(e) => match e.fd.as_ref().map(OwnedFd::try_clone) {
                Some(Ok(dup)) => {
                    e.importers += 1;
                    Ok((dup, e.size))
                }
                _ => Err(AclError::RT_FAILURE),
            },
        }
    };
    let (fd, size) = match granted {
        Ok(x) => x,
        Err(code) => {
            let _ = send_reply(&conn, code.0, 0, None);
            return;
        }
    };
    if send_reply(&conn, 0, size, Some(&fd)).is_err() {
        importer_left(handle);
        return;
    }
    drop(fd);
    // The importer holds the memory until it closes its end (or exits).
    let watch = move || {
        let _ = conn.set_read_timeout(None);
        let mut byte = [0u8; 1];
        loop {
            match conn.read(&mut byte) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        importer_left(handle);
    };
    let spawned = std::thread::Builder::new()
        .name("acl-sim-link".into())
        .stack_size(64 << 10)
        .spawn(watch);
    if spawned.is_err() {
        // Cannot watch: count the importer gone now rather than never.
        importer_left(handle);
    }
}

/// An import this process holds.
#[derive(Debug)]
struct Imported {
    /// The process that imported it.
    pid: u32,
    /// The descriptor of its link to the exporter, once made.
    link: Option<RawFd>,
}

/// Shareable handles this process holds imported, by handle. A child made by `fork` holds
/// none of its parent's imports: it empties the table (see [`release_after_fork`]).
///
/// Invariant: an entry of this process lives exactly as long as its [`ImportClaim`].
static IMPORTED: LazyLock<Mutex<HashMap<u64, Imported>>> = LazyLock::new(Default::default);

fn imported() -> MutexGuard<'static, HashMap<u64, Imported>> {
    // Entries are updated in one step each; a panic elsewhere leaves them consistent.
    IMPORTED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// This process's hold on an imported shareable handle; let go on drop.
#[derive(Debug)]
pub(super) struct ImportClaim(u64);

impl ImportClaim {
    /// Notes the link the import keeps open, for a child made by `fork` to let go of.
    pub(super) fn link(&self, link: &UnixStream) {
        if let Some(i) = imported().get_mut(&self.0) {
            i.link = Some(link.as_raw_fd());
        }
    }
}

impl Drop for ImportClaim {
    fn drop(&mut self) {
        let mut imported = imported();
        if imported
            .get(&self.0)
            .is_some_and(|i| i.pid == std::process::id())
        {
            imported.remove(&self.0);
        }
    }
}

/// Claims `handle` for an import by this process. The runtime maps handles and shareable
/// handles one to one within a process, so a handle this process holds imported already is
/// refused. (The runtime also imports only across processes; the simulator lets a process
/// import what it exported itself, so that tests and examples can play both sides.)
pub(super) fn claim_import(handle: u64) -> Result<ImportClaim, AclError> {
    let pid = std::process::id();
    let mut imported = imported();
    if imported.get(&handle).is_some_and(|i| i.pid == pid) {
        return Err(AclError::RT_PARAM_INVALID);
    }
    imported.insert(handle, Imported { pid, link: None });
    Ok(ImportClaim(handle))
}

/// Asks the exporting process for `handle`: the memory object, its size, and the link
/// that stays open while this process holds it.
pub(super) fn import(handle: u64) -> Result<(OwnedFd, u64, UnixStream), AclError> {
    let (pid, instance) = (
        (handle >> 42) as u32,
        (handle >> 32) as u32 & (INSTANCES - 1),
    );
    if pid == 0 || handle as u32 == 0 {
        return Err(AclError::RT_INVALID_HANDLE);
    }
    let addr = socket_addr(pid, instance).map_err(|_| AclError::RT_INVALID_HANDLE)?;
    // No listener: the process is gone or never exported anything.
    let mut conn = UnixStream::connect_addr(&addr).map_err(|_| AclError::RT_INVALID_HANDLE)?;
    let _ = conn.set_read_timeout(Some(EXCHANGE_TIMEOUT));
    let _ = conn.set_write_timeout(Some(EXCHANGE_TIMEOUT));
    conn.write_all(&handle.to_le_bytes())
        .map_err(|_| AclError::RT_FAILURE)?;
    let (code, size, fd) = recv_reply(&conn).map_err(|_| AclError::RT_FAILURE)?;
    AclError::check(code)?;
    let fd = fd.ok_or(AclError::RT_FAILURE)?;
    let _ = conn.set_read_timeout(None);
    Ok((fd, size, conn))
}

/// The process id of the other end of `conn`, as the kernel recorded it at connect time.
fn peer_pid(conn: &UnixStream) -> Option<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals of the sizes given; the socket is open.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid)
}

/// Room for one descriptor's control message, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct Control([u8; 64]);

/// Sends `code` and `size`, with `fd` attached when given.
fn send_reply(conn: &UnixStream, code: i32, size: u64, fd: Option<&OwnedFd>) -> io::Result<()> {
    let mut payload = [0u8; 12];
    payload[..4].copy_from_slice(&code.to_le_bytes());
    payload[4..].copy_from_slice(&size.to_le_bytes());
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    let mut control = Control([0; 64]);
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        let fd_len = std::mem::size_of::<RawFd>() as u32;
        // SAFETY: CMSG_SPACE is pure arithmetic.
        let space = unsafe { libc::CMSG_SPACE(fd_len) } as usize;
        debug_assert!(space <= control.0.len());
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` points at `control`, large and aligned enough for one header with
        // one descriptor, so the first header and its data lie inside it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_len) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd.as_raw_fd());
        }
    }
    // SAFETY: `msg` and everything it points at are live for the call.
    let sent = unsafe { libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent == payload.len() as isize {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Receives what [`send_reply`] sent.
fn recv_reply(conn: &UnixStream) -> io::Result<(i32, u64, Option<OwnedFd>)> {
    let mut payload = [0u8; 12];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    let mut control = Control([0; 64]);
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = control.0.len() as _;
    // SAFETY: `msg` and the buffers it points at are live and writable for the call.
    let got = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fd = None;
    // SAFETY: the kernel filled `control` with `msg_controllen` bytes of well-formed headers;
    // the CMSG macros walk them inside that length.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
                // The kernel installed `raw` in this process for us alone.
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if got as usize != payload.len() {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let code = i32::from_le_bytes(payload[..4].try_into().expect("4 bytes"));
    let size = u64::from_le_bytes(payload[4..].try_into().expect("8 bytes"));
    Ok((code, size, fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicI32, AtomicUsize};
    use std::time::Instant;

    /// Threads the test's signal handler ran on, in order (a handler may only store).
    static HANDLED_ON: [AtomicI32; 64] = [const { AtomicI32::new(0) }; 64];
    static HANDLED: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn note_thread(_: libc::c_int) {
        // SAFETY: gettid has no preconditions and is async-signal-safe.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
        let i = HANDLED.fetch_add(1, Ordering::SeqCst);
        if let Some(slot) = HANDLED_ON.get(i) {
            slot.store(tid, Ordering::SeqCst);
        }
    }

    /// This process's link watchers: thread id, and the system call each is blocked in
    /// (`/proc/.../syscall`: number and first argument, or "running").
    fn link_watchers() -> Vec<(i32, String)> {
        let mut found = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let path = task.path();
            let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
            if comm.trim_end() == "acl-sim-link" {
                let tid = task.file_name().to_str().unwrap().parse().unwrap();
                found.push((tid, blocked_in(tid)));
            }
        }
        found
    }

    /// "gone" once the thread has ended.
    fn blocked_in(tid: i32) -> String {
        let call = std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall"));
        let call = call.unwrap_or_else(|_| "gone".into());
        call.split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn importers(handle: u64) -> Option<u32> {
        exports().get(&handle).map(|e| e.importers)
    }

    /// A read of the link interrupted by a signal is retried: the importer still holds the
    /// memory, and only the link's end lets it go.
    #[test]
    #[cfg_attr(miri, ignore = "sockets, signals and /proc")]
    fn an_interrupted_link_read_keeps_the_importer() {
        let fd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let handle = export(fd, 4096, false).unwrap();
        let before: Vec<i32> = link_watchers().into_iter().map(|(t, _)| t).collect();
        let (_fd, size, link) = import(handle).unwrap();
        assert_eq!((size, importers(handle)), (4096, Some(1)));
        // The new watcher (with others of tests running beside this one): wait until each
        // is blocked reading its link.
        let deadline = Instant::now() + Duration::from_secs(10);
        let watchers = loop {
            let w: Vec<_> = link_watchers()
                .into_iter()
                .filter(|(t, _)| !before.contains(t))
                .collect();
            if !w.is_empty() && w.iter().all(|(_, call)| call != "running") {
                break w;
            }
            assert!(Instant::now() < deadline, "no watcher blocked: {w:?}");
            std::thread::yield_now();
        };
        // A handler without SA_RESTART, so the blocked read returns EINTR.
        // SAFETY: a zeroed sigaction is valid; the handler only stores to atomics.
        let old = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = note_thread as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut action.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(libc::SIGUSR1, &action, &mut old), 0);
            old
        };
        let handled = |tid: i32| {
            let n = HANDLED.load(Ordering::SeqCst).min(HANDLED_ON.len());
            HANDLED_ON[..n]
                .iter()
                .any(|t| t.load(Ordering::SeqCst) == tid)
        };
        for &(tid, _) in &watchers {
            // SAFETY: tgkill only sends the signal; the handler is installed.
            unsafe { libc::syscall(libc::SYS_tgkill, std::process::id(), tid, libc::SIGUSR1) };
        }
        // Each watcher ran the handler and is blocked in its read again, or has ended (a
        // link of another test that closed meanwhile, or this one given up).
        let deadline = Instant::now() + Duration::from_secs(10);
        for (tid, call) in &watchers {
            loop {
                let now = blocked_in(*tid);
                if now == "gone" || (handled(*tid) && now == *call) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "watcher {tid}: {now}, was {call}"
                );
                std::thread::yield_now();
            }
        }
        // SAFETY: puts back the action read above.
        unsafe { libc::sigaction(libc::SIGUSR1, &old, std::ptr::null_mut()) };
        assert_eq!(
            importers(handle),
            Some(1),
            "the interrupted read let the importer go"
        );
        // The link's end does.
        drop(link);
        let deadline = Instant::now() + Duration::from_secs(10);
        while importers(handle) != Some(0) {
            assert!(Instant::now() < deadline, "the link's end was not seen");
            std::thread::yield_now();
        }
        assert!(
            close_export(handle, Box::new(|| {})).is_err(),
            "no importer left"
        );
        assert_eq!(importers(handle), None);
    }

    /// Every export of a process goes through one service instance: a second would be a
    /// second listening thread, and a process may run only `INSTANCES` of them.
    #[test]
    #[cfg_attr(miri, ignore = "sockets")]
    fn a_process_serves_every_export_from_one_instance() {
        let null = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let (a, b) = (
            export(null(), 4096, false).unwrap(),
            export(null(), 4096, false).unwrap(),
        );
        let instance = |h: u64| (h >> 32) as u32 & (INSTANCES - 1);
        assert_eq!(instance(a), instance(b));
        assert_eq!(
            (a >> 42, b >> 42),
            (u64::from(std::process::id()), u64::from(std::process::id()))
        );
        for h in [a, b] {
            assert!(close_export(h, Box::new(|| {})).is_err(), "no importer");
        }
    }

    /// A fork waits for the table of exports held by another thread, and the child finds it
    /// free: without the fork handlers the child would inherit it held by a thread it does
    /// not have, and wait for ever.
    #[test]
    #[cfg_attr(miri, ignore = "fork")]
    fn a_child_never_inherits_the_export_table_held() {
        crate::fork::watch();
        let held = exports();
        let (forked, returned) = std::sync::mpsc::channel();
        let forker = std::thread::spawn(move || {
            // SAFETY: the child takes a lock and ends, calling nothing that is not fork-safe.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: plain calls; a child that hangs ends with SIGALRM.
                unsafe {
                    libc::alarm(10);
                    drop(exports());
                    libc::_exit(0);
                }
            }
            forked.send(()).unwrap();
            let mut status = 0;
            // SAFETY: `status` is a live out-pointer; `pid` is this process's child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            status
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            returned.try_recv().is_err(),
            "fork returned while another thread held the table"
        );
        drop(held);
        let status = forker.join().unwrap();
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child hung or failed (wait status {status:#x})"
        );
    }

    /// Whitelisting a process it already lets in adds nothing: a server that publishes each
    /// request's tensor to the same reader (regions of one chunk, one export) would grow the
    /// whitelist by a process id per publish, for as long as the chunk lives.
    #[test]
    #[cfg_attr(miri, ignore = "sockets")]
    fn the_whitelist_holds_each_process_once() {
        let fd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let handle = export(fd, 4096, true).unwrap();
        let whitelisted = || exports().get(&handle).map(|e| e.whitelist.len());
        for _ in 0..1000 {
            allow(handle, &[7, 8]).unwrap();
        }
        assert_eq!(whitelisted(), Some(2));
        for _ in 0..1000 {
            allow(handle, &[8, 9, 9]).unwrap();
        }
        assert_eq!(whitelisted(), Some(3));
        assert!(
            close_export(handle, Box::new(|| {})).is_err(),
            "no importer"
        );
    }
}
