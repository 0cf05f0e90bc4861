//! The raw layer: every librdmacm / libibverbs / libc item rdmasafe uses is
//! reached through this module, and nothing outside it declares FFI.
//!
//! **Unstable**: public for rdmasafe's own C library and tests, not part of
//! the crate's semver-stable API. Applications use the safe types, and
//! their documented raw getters where interop needs a pointer.
//!
//! Bindings come from the `rdma-sys` crate (bindgen over Debian's rdma-core
//! headers, plus hand-written Rust versions of verbs.h's static inline
//! functions such as `ibv_poll_cq`). Where rdma-sys gets something wrong for
//! our purposes, the fix lives here, with the reason next to it:
//!
//! * `rdma_sys::ibv_async_event::event_type` is a Rust enum; a kernel newer
//!   than the headers can report a value outside it, which would be undefined
//!   behaviour to read. [`RawAsyncEvent`] declares the same C layout with a
//!   plain `u32` and [`ibv_get_async_event`] / [`ibv_ack_async_event`] are
//!   declared against it.
//! * CM event types are a `u32` in rdma-sys already (constified enum); we keep
//!   them that way (see [`crate::cm::EventType`]).
//! * `rdma_get_cm_event` and `rdma_ack_cm_event` are not re-exported: the CM
//!   code reaches them only through [`get_cm_event`] / [`ack_cm_event`],
//!   which go through a table an `LD_PRELOAD` build of rdmasafe points at
//!   librdmacm's real functions ([`set_cm_event_calls`]); inside such a
//!   library the plain symbols are its own interposers.
//!
//! The C struct layouts rdmasafe relies on (`struct rdma_cm_event`, the
//! `param` union, `struct ibv_wc`) are checked against the real C headers by
//! the `layout_matches_c_headers` test, which compiles a C probe with `cc`.

#![allow(unused_imports)]

use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

pub mod cancel;
pub mod fork_lock;
pub mod fork_once;

pub use rdma_sys::{
    ibv_ack_cq_events, ibv_alloc_pd, ibv_comp_channel, ibv_context, ibv_cq, ibv_create_comp_channel, ibv_create_cq,
    ibv_dealloc_pd, ibv_dereg_mr, ibv_destroy_comp_channel, ibv_destroy_cq, ibv_device, ibv_free_device_list,
    ibv_get_cq_event, ibv_get_device_list, ibv_get_device_name, ibv_mr, ibv_pd, ibv_poll_cq, ibv_post_recv,
    ibv_post_send, ibv_qp, ibv_qp_init_attr, ibv_qp_type, ibv_recv_wr, ibv_reg_mr, ibv_req_notify_cq, ibv_send_flags,
    ibv_send_wr, ibv_sge, ibv_wc, ibv_wc_flags, ibv_wc_opcode, ibv_wc_status, ibv_wc_status_str, ibv_wr_opcode,
    param_t, rdma_accept, rdma_bind_addr, rdma_cm_event, rdma_cm_event_type, rdma_cm_id, rdma_conn_param, rdma_connect,
    rdma_create_event_channel, rdma_create_id, rdma_create_qp, rdma_destroy_event_channel, rdma_destroy_id,
    rdma_destroy_qp, rdma_disconnect, rdma_event_channel, rdma_free_devices, rdma_get_devices, rdma_get_src_port,
    rdma_listen, rdma_migrate_id, rdma_port_space, rdma_reject, rdma_resolve_addr, rdma_resolve_route, rdma_t,
    rdma_ud_param,
};

/// `RDMA_MAX_PRIVATE_DATA` from librdmacm: the largest private data any CM
/// event can carry (the field is a `u8` length, so 255 in practice).
pub const RDMA_MAX_PRIVATE_DATA: usize = 256;

/// `struct ibv_async_event` with the event type as a plain number.
/// rdma-sys models the type as a Rust enum, which a value from a newer
/// kernel would make undefined behaviour.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawAsyncEvent {
    /// Union of `ibv_cq *`, `ibv_qp *`, `ibv_srq *`, `ibv_wq *`, `int port_num`.
    pub element: *mut c_void,
    /// `enum ibv_event_type` as reported.
    pub event_type: u32,
}

extern "C" {
    /// libibverbs' `ibv_get_async_event`, declared with [`RawAsyncEvent`].
    #[link_name = "ibv_get_async_event"]
    pub fn ibv_get_async_event(context: *mut ibv_context, event: *mut RawAsyncEvent) -> c_int;
    /// libibverbs' `ibv_ack_async_event`, declared with [`RawAsyncEvent`].
    #[link_name = "ibv_ack_async_event"]
    pub fn ibv_ack_async_event(event: *mut RawAsyncEvent);
}

extern "C-unwind" {
    /// librdmacm's `rdma_get_cm_event`, declared as a call that may unwind:
    /// its `write()` is a cancellation point, and a thread cancelled there
    /// unwinds through its callers ([`cancel`]).
    #[link_name = "rdma_get_cm_event"]
    fn rdma_get_cm_event_unwinding(channel: *mut rdma_event_channel, event: *mut *mut rdma_cm_event) -> c_int;
}

/// `rdma_get_cm_event`'s C type (a cancellation point: it may unwind).
pub type GetCmEventFn = unsafe extern "C-unwind" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int;
/// `rdma_ack_cm_event`'s C type.
pub type AckCmEventFn = unsafe extern "C" fn(*mut rdma_cm_event) -> c_int;

/// The two librdmacm calls of the CM event path, as rdmasafe makes them.
#[derive(Clone, Copy, Debug)]
pub struct CmEventCalls {
    /// Gets the next event (`rdma_get_cm_event`).
    pub get: GetCmEventFn,
    /// Acks an event `get` returned (`rdma_ack_cm_event`).
    pub ack: AckCmEventFn,
}

/// librdmacm's functions, reached through the symbols the linker binds.
const LIBRDMACM_CM_EVENT_CALLS: CmEventCalls =
    CmEventCalls { get: rdma_get_cm_event_unwinding, ack: rdma_sys::rdma_ack_cm_event };

static CM_EVENT_CALLS: std::sync::OnceLock<CmEventCalls> = std::sync::OnceLock::new();

/// The table in use; the first use freezes it (default: librdmacm's symbols).
#[inline]
fn cm_event_calls() -> &'static CmEventCalls {
    CM_EVENT_CALLS.get_or_init(|| LIBRDMACM_CM_EVENT_CALLS)
}

/// Points rdmasafe's CM event path at other implementations of
/// `rdma_get_cm_event` / `rdma_ack_cm_event`. For a library that *defines*
/// those two symbols (the `LD_PRELOAD` interposer, `rdmasafe-preload`):
/// there the symbols resolve to its own interposers, so rdmasafe must call
/// librdmacm's real functions (from `dlvsym`) instead, or recurse.
///
/// Only the first call before any CM event is got takes effect; later it
/// returns `Err` with the calls given, and the table stays as it was,
/// unless the table holds these very calls (set by an earlier call: a
/// forked child's second set-up, say): then `Ok`.
///
/// # Safety
/// `calls.get` and `calls.ack` must behave as librdmacm's two functions of
/// one and the same librdmacm (an event from `get` is acked by `ack`),
/// callable from any thread for the rest of the process.
pub unsafe fn set_cm_event_calls(calls: CmEventCalls) -> Result<(), CmEventCalls> {
    match CM_EVENT_CALLS.set(calls) {
        Ok(()) => Ok(()),
        Err(calls) => {
            let now = cm_event_calls();
            if now.get as usize == calls.get as usize && now.ack as usize == calls.ack as usize {
                Ok(())
            } else {
                Err(calls)
            }
        }
    }
}

/// `rdma_get_cm_event` through the table ([`set_cm_event_calls`]).
///
/// # Safety
/// As `rdma_get_cm_event`: `channel` a live event channel, `event` writable.
#[inline]
pub unsafe fn get_cm_event(channel: *mut rdma_event_channel, event: *mut *mut rdma_cm_event) -> c_int {
    // SAFETY: the table holds rdma_get_cm_event or a function that behaves
    // as it (set_cm_event_calls' contract); the caller's contract is its.
    unsafe { (cm_event_calls().get)(channel, event) }
}

/// `rdma_ack_cm_event` through the table ([`set_cm_event_calls`]).
///
/// # Safety
/// As `rdma_ack_cm_event`: `event` from [`get_cm_event`], not acked yet.
#[inline]
pub unsafe fn ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    // SAFETY: as in get_cm_event.
    unsafe { (cm_event_calls().ack)(event) }
}

/// The calling thread's errno.
pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// The calling thread's errno as it is (0 included), for saving and
/// restoring around calls that must leave it untouched.
pub fn errno_raw() -> i32 {
    // SAFETY: __errno_location always returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() }
}

/// The address of the calling thread's errno: valid for as long as the
/// thread lives, and only to be used on it (save + restore with one lookup).
#[inline]
pub fn errno_slot() -> *mut i32 {
    // SAFETY: __errno_location has no precondition; it returns the calling
    // thread's errno slot.
    unsafe { libc::__errno_location() }
}

/// Sets the calling thread's errno (the C API's -1/errno convention).
pub fn set_errno(value: i32) {
    // SAFETY: __errno_location always returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() = value };
}

/// Runs `f` and gives the calling thread's errno back the value it had
/// before, whatever `f` set it to (a signal handler or a caller that
/// reads errno after us sees its own).
#[inline(always)]
pub fn keeping_errno<T>(f: impl FnOnce() -> T) -> T {
    let saved = errno_raw();
    let r = f();
    set_errno(saved);
    r
}

/// Reserves `bytes` of address space, inaccessible until [`commit`]ed
/// (`mmap(PROT_NONE, MAP_NORESERVE)`: costs no memory). Never unmapped:
/// rdmasafe's CM event slots live there for the life of the process, so a
/// pointer into the region stays readable whatever the app does with it.
pub fn reserve_address_space(bytes: usize) -> std::io::Result<NonNull<u8>> {
    // SAFETY: an anonymous mapping at an address the kernel picks; no
    // existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(NonNull::new(p.cast()).expect("mmap never returns NULL on success"))
}

/// The process's address-space limit (`RLIMIT_AS`) in bytes, `None` when
/// unlimited (the default) or unknown.
pub fn address_space_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: r is a valid rlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// Makes `bytes` at `at` (inside a [`reserve_address_space`] region,
/// page-aligned) readable and writable; the pages read as zero.
///
/// # Safety
/// `at..at + bytes` must lie in a reserved region and not be in use.
pub unsafe fn commit(at: NonNull<u8>, bytes: usize) -> std::io::Result<()> {
    // SAFETY: the range is ours (caller's contract).
    if unsafe { libc::mprotect(at.as_ptr().cast(), bytes, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `id->event`: the event librdmacm keeps as a synchronous id's current
/// one (`ucma_complete` stores it until the next, or the id's destroy,
/// which acks it before it waits); NULL for other ids.
///
/// # Safety
/// `id` must be a live id (e.g. the id of an event not acked yet).
/// librdmacm may be writing the field on another thread: a volatile read
/// of an aligned pointer sees the old or the new value.
pub unsafe fn current_event(id: *const rdma_cm_id) -> *mut rdma_cm_event {
    // SAFETY: live (caller); an aligned pointer field.
    unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*id).event)) }
}

/// A coarse monotonic clock in milliseconds (`CLOCK_MONOTONIC_COARSE`,
/// a few ms of resolution). It is read from the vDSO's data page without
/// touching the hardware clock, so it is no system call even on VMs whose
/// clocksource (hpet) makes `CLOCK_MONOTONIC` one.
#[inline]
pub fn coarse_now_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer; this clock id exists since 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// Reads an fd's status flags (`fcntl(F_GETFL)`).
pub fn fd_flags(fd: c_int) -> std::io::Result<c_int> {
    // SAFETY: F_GETFL takes no pointer argument; a bad fd gives EBADF.
    let r = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// True if the fd has O_NONBLOCK set.
pub fn is_nonblocking(fd: c_int) -> std::io::Result<bool> {
    Ok(fd_flags(fd)? & libc::O_NONBLOCK != 0)
}

/// Sets O_NONBLOCK on an fd rdmasafe owns.
pub fn set_nonblocking(fd: c_int) -> std::io::Result<()> {
    let flags = fd_flags(fd)?;
    // SAFETY: F_SETFL with an integer argument; a bad fd gives EBADF.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub use crate::wait::Wait;

/// Waits until one of `fds` is readable, for at most `wait`.
/// Returns the readiness of each fd (`true` = readable or error/hangup), all
/// `false` on timeout. EINTR restarts the wait with the time that is left.
pub fn poll_readable<const N: usize>(fds: [c_int; N], wait: Wait) -> std::io::Result<[bool; N]> {
    poll_readable_ex(fds, wait, true)
}

/// Like [`poll_readable`]; with `retry_eintr == false` a signal ends the
/// wait with an EINTR error, as the blocking librdmacm calls do.
pub fn poll_readable_ex<const N: usize>(fds: [c_int; N], wait: Wait, retry_eintr: bool) -> std::io::Result<[bool; N]> {
    let deadline = match wait {
        Wait::For(d) => Some(deadline_after(Instant::now(), d)),
        _ => None,
    };
    let mut pfds = fds.map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
    loop {
        let timeout_ms = deadline.map_or(wait, Wait::until).poll_ms();
        // SAFETY: pfds is a valid array of N pollfd structs for the call.
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), N as libc::nfds_t, timeout_ms) };
        if r >= 0 {
            return Ok(pfds.map(|p| p.revents != 0));
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) || !retry_eintr {
            return Err(err);
        }
    }
}

/// An eventfd used to wake a thread blocked in poll() (closing an fd does
/// not wake a thread blocked on it, so stop requests go through this).
#[derive(Debug)]
pub struct WakeFd(std::os::fd::OwnedFd);

impl WakeFd {
    /// A non-blocking, close-on-exec eventfd.
    pub fn new() -> std::io::Result<WakeFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: eventfd takes no pointers; a negative result is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        Ok(WakeFd(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes the fd readable (wakes pollers). Async-signal-safe: one
    /// write system call, and errno is kept as it was. Made with
    /// `syscall(2)`, not libc's `write()`: never a thread-cancellation
    /// point (the eventfd never blocks), so a thread with a cancellation
    /// pending may wake a loop (`rdmasafe_cq_loop_stop`) without being
    /// unwound out of rdmasafe.
    pub fn wake(&self) {
        use std::os::fd::AsRawFd;
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64; failure (counter full)
        // still leaves the fd readable, which is all a wake needs.
        keeping_errno(|| unsafe {
            libc::syscall(
                libc::SYS_write,
                self.0.as_raw_fd() as libc::c_long,
                (&one as *const u64).cast::<c_void>(),
                8usize,
            )
        });
    }

    /// Resets the fd to not readable (a read system call, not a
    /// cancellation point, as in [`WakeFd::wake`]).
    pub fn drain(&self) {
        use std::os::fd::AsRawFd;
        read_counter(self.0.as_raw_fd());
    }

    /// The fd, for poll().
    pub fn fd(&self) -> c_int {
        use std::os::fd::AsRawFd;
        self.0.as_raw_fd()
    }
}

/// Reads (and so resets) the 8-byte counter of a non-blocking eventfd or
/// timerfd; EAGAIN when it is already zero. A raw system call, not libc's
/// `read()`: never a thread-cancellation point (it cannot block).
fn read_counter(fd: c_int) {
    let mut v: u64 = 0;
    // SAFETY: reads at most 8 bytes into a valid u64.
    unsafe { libc::syscall(libc::SYS_read, fd as libc::c_long, (&mut v as *mut u64).cast::<c_void>(), 8usize) };
}

/// Sleeps while `word` holds `expected` (`FUTEX_WAIT_PRIVATE`, no
/// timeout), until a [`futex_wake_one`] of it; returns at once if it holds
/// another value, and may return spuriously (the caller checks again).
/// A raw system call: no thread-cancellation point; errno is kept.
pub fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32) {
    // SAFETY: a live, aligned 32-bit word private to this process; no
    // timeout (NULL).
    keeping_errno(|| unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        )
    });
}

/// Wakes one thread sleeping in [`futex_wait`] on `word`, if any. A raw
/// system call, as there; errno is kept.
pub fn futex_wake_one(word: &std::sync::atomic::AtomicU32) {
    // SAFETY: a live, aligned 32-bit word private to this process.
    keeping_errno(|| unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1)
    });
}

/// A zero-filled page of memory that the kernel zero-fills again in a
/// forked child (`MADV_WIPEONFORK`, Linux 4.14): for state that must not
/// outlive a fork (a thread's, which the child does not have). Never
/// unmapped. None if it cannot be mapped or marked.
pub fn wipe_on_fork_page() -> Option<NonNull<u8>> {
    const PAGE: usize = 4096;
    // SAFETY: an anonymous private mapping at an address the kernel picks.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: the mapping just made (its length rounds up to the page size).
    if unsafe { libc::madvise(p, PAGE, libc::MADV_WIPEONFORK) } != 0 {
        // SAFETY: the mapping just made, unmapped once, never used.
        unsafe { libc::munmap(p, PAGE) };
        return None;
    }
    NonNull::new(p.cast())
}

/// Has `child` run in the child of every later `fork()` (glibc's
/// `pthread_atfork`; a child made by the raw system call or `vfork` runs
/// no handler). Handlers are unregistered only when the library that
/// registered them is unloaded (glibc keys them by its `__dso_handle`).
/// False if there was no memory to register it.
pub fn at_fork_child(child: unsafe extern "C" fn()) -> bool {
    extern "C" {
        fn pthread_atfork(
            prepare: Option<unsafe extern "C" fn()>,
            parent: Option<unsafe extern "C" fn()>,
            child: Option<unsafe extern "C" fn()>,
        ) -> c_int;
    }
    // SAFETY: registers a function pointer that lives as long as this
    // library (its code); the caller's `child` runs in a single-threaded
    // child, where it must do only what is async-signal-safe.
    unsafe { pthread_atfork(None, None, Some(child)) == 0 }
}

/// An fd returned by a call that creates one, or the errno.
fn owned_fd(fd: c_int) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// An epoll instance (`epoll_create1(EPOLL_CLOEXEC)`): one fd that is
/// readable when any fd registered in it is.
#[derive(Debug)]
pub struct Epoll(std::os::fd::OwnedFd);

impl Epoll {
    /// A new, empty epoll instance.
    pub fn new() -> std::io::Result<Epoll> {
        // SAFETY: no pointers.
        owned_fd(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }).map(Epoll)
    }

    /// Watches `fd` for readability; `key` comes back in [`Epoll::wait`].
    pub fn add(&self, fd: c_int, key: u64) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: key };
        // SAFETY: ev is valid for the call; a bad fd gives EBADF.
        if unsafe { libc::epoll_ctl(self.0.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits at most `timeout_ms` (-1: forever, 0: not at all) and returns
    /// the keys of the ready fds as bits (`1 << key`, keys below 64).
    /// EINTR is returned as an error.
    pub fn wait(&self, timeout_ms: c_int) -> std::io::Result<u64> {
        use std::os::fd::AsRawFd;
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 8];
        // SAFETY: evs has room for 8 events.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), evs.as_mut_ptr(), 8, timeout_ms) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(evs[..n as usize].iter().fold(0, |m, e| m | 1u64 << (e.u64 & 63)))
    }

    /// The epoll fd (readable when a watched fd is).
    pub fn fd(&self) -> c_int {
        use std::os::fd::AsRawFd;
        self.0.as_raw_fd()
    }
}

/// A non-blocking monotonic timerfd: readable once its deadline passed.
#[derive(Debug)]
pub struct TimerFd(std::os::fd::OwnedFd);

impl TimerFd {
    /// A disarmed timer.
    pub fn new() -> std::io::Result<TimerFd> {
        // SAFETY: no pointers.
        owned_fd(unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) })
            .map(TimerFd)
    }

    /// Arms the timer to fire `after` from now (`None`: disarm). A zero
    /// `after` fires at once.
    pub fn set(&self, after: Option<Duration>) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let value = match after {
            // A zero it_value would disarm: fire in 1 ns instead.
            Some(d) => libc::timespec {
                tv_sec: d.as_secs().min(i64::MAX as u64 / 2) as libc::time_t,
                tv_nsec: if d.is_zero() { 1 } else { d.subsec_nanos() as libc::c_long },
            },
            None => libc::timespec { tv_sec: 0, tv_nsec: 0 },
        };
        let spec = libc::itimerspec { it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 }, it_value: value };
        // SAFETY: spec is valid for the call; no old value wanted.
        if unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Consumes an expiry (the fd is then not readable until the next).
    /// Not a cancellation point, as [`WakeFd::drain`].
    pub fn drain(&self) {
        use std::os::fd::AsRawFd;
        read_counter(self.0.as_raw_fd());
    }

    /// The timer's fd.
    pub fn fd(&self) -> c_int {
        use std::os::fd::AsRawFd;
        self.0.as_raw_fd()
    }
}

/// Sets an fd's status flags (`fcntl(F_SETFL)`), e.g. to restore them.
pub fn set_fd_flags(fd: c_int, flags: c_int) -> std::io::Result<()> {
    // SAFETY: F_SETFL with an integer argument; a bad fd gives EBADF.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Starts a thread of rdmasafe's own (one the app did not ask for: the CM
/// ack-deadline thread, its log writer, which may call the app's log
/// callback, the preload's check thread) with every signal blocked, so that
/// a signal sent to the process is never delivered to it. It would be
/// otherwise: a thread inherits the mask of the thread that creates it,
/// and these are created lazily (at the first CM get), from whatever app
/// thread gets first, before the app blocks, say, SIGTERM everywhere and
/// waits for it in one thread (`sigwait`, `signalfd`); the kernel then
/// delivers the process's SIGTERM to the one thread that does not block
/// it, and its default action ends the process. (glibc keeps its own
/// cancellation and set*id signals deliverable whatever the mask.)
pub fn spawn_signals_blocked<F, T>(name: &str, f: F) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    // SAFETY: a sigset_t filled by sigfillset before use; pthread_sigmask
    // changes only the calling thread's mask, given back below (a signal
    // that comes meanwhile stays pending and is delivered then).
    let old = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        // It returns the error number (errno is left alone).
        let rc = libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        old
    };
    let spawned = std::thread::Builder::new().name(name.into()).spawn(f);
    // SAFETY: `old` is the mask pthread_sigmask gave back above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    spawned
}

/// A number naming the calling thread, odd (never 0, nor an even marker
/// such as `cq::NOT_POLLED_YET`), and never given to another thread of the
/// process, for "am I the thread that runs (or polled) this loop?". Not
/// `pthread_self()`: glibc gives an exited thread's to the next thread it
/// makes, which was then taken for the loop's driver (found by a review:
/// a blocking drain from a new thread ran the handlers itself while an
/// async run lived on). A forked child's thread keeps its number.
pub fn thread_tag() -> u64 {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        // No destructor: usable while the thread's other locals go.
        static TAG: Cell<u64> = const { Cell::new(0) };
    }
    TAG.with(|t| match t.get() {
        0 => {
            let tag = NEXT.fetch_add(2, Relaxed);
            t.set(tag);
            tag
        }
        tag => tag,
    })
}

/// `now + d`, or a time so far ahead that it never comes when that
/// overflows (`Duration::MAX` timeouts and periods).
pub fn deadline_after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Pins the calling thread to one CPU (`sched_setaffinity`).
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: cpu_set_t is plain data; CPU_SET stays in bounds (checked).
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// CPUs of the NUMA node an RDMA device sits on, from sysfs
/// (`/sys/class/infiniband/DEV/device/numa_node`). `None` when the device
/// has no node (Soft-RoCE, single-node machines).
pub fn device_numa_cpus(device: &str) -> Option<Vec<usize>> {
    let node = std::fs::read_to_string(format!("/sys/class/infiniband/{device}/device/numa_node")).ok()?;
    let node: i32 = node.trim().parse().ok()?;
    if node < 0 {
        return None;
    }
    let list = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist")).ok()?;
    parse_cpu_list(list.trim())
}

/// Parses a kernel CPU list such as `0-3,8,10-11`.
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// Moves a QP to the error state (`ibv_modify_qp`).
///
/// # Safety
/// `qp` must be a live QP.
pub unsafe fn qp_to_error(qp: *mut ibv_qp) -> crate::Result<()> {
    // SAFETY: live QP; attr is plain data valid for the call.
    let r = unsafe {
        let mut attr: rdma_sys::ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = rdma_sys::ibv_qp_state::IBV_QPS_ERR;
        rdma_sys::ibv_modify_qp(qp, &mut attr, rdma_sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(crate::Error::new("ibv_modify_qp(IBV_QPS_ERR)", r))
    }
}

/// Where a QP stands for sending, from its state (`ibv_query_qp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpSend {
    /// RESET, INIT, RTR: not connected yet.
    NotYet,
    /// RTS.
    Ready,
    /// SQE, ERR: moved to an error state (by whoever did, who reports it).
    Error,
    /// SQD, another state, or the query failed.
    Unknown,
}

/// `ibv_query_qp` of the attributes in `mask`; `None` if it fails.
///
/// # Safety
/// `qp` must be a live QP.
unsafe fn query_qp(qp: *mut ibv_qp, mask: rdma_sys::ibv_qp_attr_mask) -> Option<rdma_sys::ibv_qp_attr> {
    // SAFETY: live QP (caller); attr and init are plain data valid for the call.
    unsafe {
        let mut attr: rdma_sys::ibv_qp_attr = std::mem::zeroed();
        let mut init: rdma_sys::ibv_qp_init_attr = std::mem::zeroed();
        (rdma_sys::ibv_query_qp(qp, &mut attr, mask.0 as i32, &mut init) == 0).then_some(attr)
    }
}

/// Where `qp` stands for sending (an `ibv_query_qp` system call).
///
/// # Safety
/// `qp` must be a live QP.
pub unsafe fn qp_send_state(qp: *mut ibv_qp) -> QpSend {
    use rdma_sys::ibv_qp_state::*;
    // SAFETY: live QP (caller).
    let Some(attr) = (unsafe { query_qp(qp, rdma_sys::ibv_qp_attr_mask::IBV_QP_STATE) }) else {
        return QpSend::Unknown;
    };
    match attr.qp_state {
        IBV_QPS_RESET | IBV_QPS_INIT | IBV_QPS_RTR => QpSend::NotYet,
        IBV_QPS_RTS => QpSend::Ready,
        IBV_QPS_SQE | IBV_QPS_ERR => QpSend::Error,
        _ => QpSend::Unknown,
    }
}

/// The QP's local ack timeout (4.096 us * 2^timeout, from `ibv_query_qp`):
/// how long a lost packet waits before it is sent again. `None` when the
/// query fails or the timeout is 0 (infinite).
///
/// # Safety
/// `qp` must be a live QP.
pub unsafe fn qp_ack_timeout(qp: *mut ibv_qp) -> Option<Duration> {
    // SAFETY: live QP (caller).
    let t = unsafe { query_qp(qp, rdma_sys::ibv_qp_attr_mask::IBV_QP_TIMEOUT) }?.timeout;
    (t != 0).then(|| Duration::from_nanos(4096u64 << t.min(31)))
}

/// Posts a signaled zero-length RDMA WRITE (a keepalive probe: zero-length
/// RDMA operations check no rkey, and the peer's application sees nothing).
///
/// # Safety
/// `qp` must be a live RC QP.
pub unsafe fn post_zero_length_write(qp: *mut ibv_qp, wr_id: u64) -> crate::Result<()> {
    // SAFETY: live QP; a WR without buffers, valid for the call.
    let r = unsafe {
        let mut wr: ibv_send_wr = std::mem::zeroed();
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = std::ptr::null_mut();
        ibv_post_send(qp, &mut wr, &mut bad)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(crate::Error::new("ibv_post_send(keepalive probe)", r))
    }
}

/// Moves a QP to the error state and posts drain markers: if `recv`, a
/// receive without buffers with `recv_wr_id`, and a signaled zero-length
/// SEND with `send_wr_id`. Both complete (with IBV_WC_WR_FLUSH_ERR, or the
/// receive marker with whatever a message that raced in gave it) after
/// every request posted before them on their queue.
///
/// The receive marker is posted *before* the transition: rxe in Linux 6.1
/// does not flush receives posted while the QP is already in the error
/// state (measured in the test bed; the send marker posted after it is
/// flushed), whereas receives queued before it are flushed in order.
///
/// # Safety
/// `qp` must be a live QP.
///
/// On failure, also says whether the receive marker had been posted (it
/// will still come back, flushed).
pub unsafe fn qp_to_error_and_post_markers(
    qp: *mut ibv_qp,
    recv: bool,
    send_wr_id: u64,
    recv_wr_id: u64,
) -> Result<(), (crate::Error, bool)> {
    use crate::Error;
    // SAFETY (whole block): qp is live; the attr and WR structs are plain
    // data, zero-initialised, valid for the calls.
    unsafe {
        if recv {
            let mut wr: ibv_recv_wr = std::mem::zeroed();
            wr.wr_id = recv_wr_id;
            let mut bad = std::ptr::null_mut();
            let r = ibv_post_recv(qp, &mut wr, &mut bad);
            if r != 0 {
                return Err((Error::new("ibv_post_recv(drain marker)", r), false));
            }
        }
        qp_to_error(qp).map_err(|e| (e, recv))?;
        let mut wr: ibv_send_wr = std::mem::zeroed();
        wr.wr_id = send_wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = std::ptr::null_mut();
        let r = ibv_post_send(qp, &mut wr, &mut bad);
        if r != 0 {
            return Err((Error::new("ibv_post_send(drain marker)", r), recv));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};
    use std::process::Command;

    /// Threads that follow one another get different tags, also when the
    /// later one gets the earlier one's `pthread_t` (glibc reuses it: the
    /// old tag, `pthread_self() | 1`, was then the same).
    #[test]
    fn a_later_thread_never_gets_an_exited_threads_tag() {
        let here = thread_tag();
        assert_eq!(here, thread_tag(), "stable");
        assert_eq!(here & 1, 1, "odd");
        // SAFETY: pthread_self has no preconditions.
        let one = || std::thread::spawn(|| (unsafe { libc::pthread_self() } as u64, thread_tag())).join().unwrap();
        let mut reused = 0;
        let mut tags = vec![here];
        for _ in 0..20 {
            let (a, b) = (one(), one());
            reused += usize::from(a.0 == b.0);
            tags.extend([a.1, b.1]);
        }
        let n = tags.len();
        tags.sort_unstable();
        tags.dedup();
        assert_eq!(tags.len(), n, "every thread its own tag ({reused} of 20 pairs shared a pthread_t)");
    }

    /// Compiles a C probe against the installed rdma-core headers and checks
    /// that the Rust definitions rdmasafe relies on have the same layout.
    #[test]
    fn layout_matches_c_headers() {
        let dir = std::env::temp_dir().join(format!("rdmasafe-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("probe.c");
        std::fs::write(
            &src,
            r#"#include <stdio.h>
#include <stddef.h>
#include <rdma/rdma_cma.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu\n", sizeof(struct rdma_cm_event), offsetof(struct rdma_cm_event, param),
         offsetof(struct rdma_cm_event, status), sizeof(struct rdma_ud_param), offsetof(struct rdma_ud_param, qkey));
  printf("%zu %zu %zu %zu\n", sizeof(struct rdma_conn_param), offsetof(struct rdma_conn_param, qp_num),
         sizeof(struct ibv_wc), offsetof(struct ibv_wc, qp_num));
  printf("%zu %zu %zu\n", sizeof(struct ibv_async_event), offsetof(struct ibv_async_event, event_type),
         offsetof(struct rdma_cm_id, context));
  return 0;
}
"#,
        )
        .unwrap();
        let exe = dir.join("probe");
        let st = Command::new("cc").arg("-o").arg(&exe).arg(&src).status().expect("run cc");
        assert!(st.success(), "C layout probe did not compile");
        let out = Command::new(&exe).output().expect("run probe");
        let text = String::from_utf8(out.stdout).unwrap();
        let c: Vec<usize> = text.split_whitespace().map(|v| v.parse().unwrap()).collect();
        let rust = vec![
            size_of::<rdma_cm_event>(),
            offset_of!(rdma_cm_event, param),
            offset_of!(rdma_cm_event, status),
            size_of::<rdma_ud_param>(),
            offset_of!(rdma_ud_param, qkey),
            size_of::<rdma_conn_param>(),
            offset_of!(rdma_conn_param, qp_num),
            size_of::<ibv_wc>(),
            offset_of!(ibv_wc, qp_num),
            size_of::<RawAsyncEvent>(),
            offset_of!(RawAsyncEvent, event_type),
            offset_of!(rdma_cm_id, context),
        ];
        assert_eq!(c, rust, "C vs Rust layout (sizes/offsets)");
        // private_data pointer and length sit at the same offsets in both
        // union arms: the copy relies on it.
        assert_eq!(offset_of!(rdma_conn_param, private_data), offset_of!(rdma_ud_param, private_data));
        assert_eq!(offset_of!(rdma_conn_param, private_data_len), offset_of!(rdma_ud_param, private_data_len));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn poll_times_out_and_sees_readable() {
        let mut fds = [0; 2];
        // SAFETY: fds has room for the two pipe ends.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let r = poll_readable([fds[0]], Wait::For(Duration::from_millis(5))).unwrap();
        assert_eq!(r, [false]);
        // SAFETY: writing one byte from a valid buffer to the pipe.
        assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
        let r = poll_readable([fds[1], fds[0]], Wait::None).unwrap();
        assert_eq!(r, [false, true]);
        assert!(!is_nonblocking(fds[0]).unwrap());
        set_nonblocking(fds[0]).unwrap();
        assert!(is_nonblocking(fds[0]).unwrap());
        // SAFETY: closing the fds this test opened.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn wait_from_millis_follows_the_c_convention() {
        assert_eq!(Wait::from_millis(-1), Wait::Forever);
        assert_eq!(Wait::from_millis(0), Wait::None);
        assert_eq!(Wait::from_millis(7), Wait::For(Duration::from_millis(7)));
    }
}
