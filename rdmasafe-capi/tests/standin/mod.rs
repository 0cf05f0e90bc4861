//! A stand-in for librdmacm's event channel, for host tests that replace
//! librdmacm's two event calls (`sys::set_cm_event_calls`): a channel's fd
//! is a non-blocking pipe's read end, and each byte in the pipe is one
//! ready event.
#![allow(dead_code)]

use std::os::raw::c_int;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use rdmasafe_core::sys::{rdma_cm_event, rdma_event_channel};

/// A stand-in channel and its pipe's write end.
pub fn channel() -> (Box<rdma_event_channel>, c_int) {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two fds.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) }, 0);
    (Box::new(rdma_event_channel { fd: fds[0] }), fds[1])
}

/// Makes one more event ready on the channel whose write end is `w`.
pub fn ready(w: c_int) {
    // SAFETY: w is a pipe's write end; one byte from a live buffer.
    assert_eq!(unsafe { libc::write(w, b"e".as_ptr().cast(), 1) }, 1);
}

/// For a stand-in get: takes one ready event off `ch`; false (errno is
/// read()'s: EAGAIN when nothing is ready) if there is none.
///
/// # Safety
/// `ch` must be a live stand-in channel.
pub unsafe fn take_ready(ch: *mut rdma_event_channel) -> bool {
    let mut b = 0u8;
    // SAFETY: ch is live (caller); b is one writable byte.
    unsafe { libc::read((*ch).fd, (&mut b as *mut u8).cast(), 1) == 1 }
}

/// Makes one event ready on `ch` (write end `w`) and gets its copy with
/// `rdmasafe_get_event` (asserting success).
pub fn get_copy(ch: &mut rdma_event_channel, w: c_int) -> *mut rdmasafe_core::sys::rdma_cm_event {
    ready(w);
    let mut ev = std::ptr::null_mut();
    // SAFETY: a live stand-in channel; ev is writable.
    assert_eq!(unsafe { rdmasafe::rdmasafe_get_event(ch, &mut ev) }, 0);
    ev
}

/// The one event the stand-in get of [`install_calls`] hands out (a zeroed
/// event: no id, no private data), and the acks of it so far.
static EVENT: AtomicUsize = AtomicUsize::new(0);
pub static ACKS: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C-unwind" fn standin_get(ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int {
    // SAFETY: ch is a test's stand-in channel.
    if !unsafe { take_ready(ch) } {
        return -1;
    }
    // SAFETY: ev is writable (rdmasafe's contract with librdmacm's call).
    unsafe { *ev = EVENT.load(Relaxed) as *mut rdma_cm_event };
    0
}

unsafe extern "C" fn standin_ack(_ev: *mut rdma_cm_event) -> c_int {
    ACKS.fetch_add(1, Relaxed);
    0
}

/// Replaces librdmacm's two event calls with the stand-in pair: a get
/// takes one ready byte off the channel and hands out a zeroed event, an
/// ack counts in [`ACKS`]. Call first, before any CM call of the process.
pub fn install_calls() {
    EVENT.store(Box::into_raw(rdmasafe_core::cm::SyntheticEvent::zeroed()) as usize, Relaxed);
    // SAFETY: the pair behaves as librdmacm's for one zeroed event, from
    // any thread.
    unsafe {
        rdmasafe_core::sys::set_cm_event_calls(rdmasafe_core::sys::CmEventCalls { get: standin_get, ack: standin_ack })
    }
    .expect("first CM use of this process");
}

/// This process's address space in use now (VmSize), in bytes.
pub fn vm_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).expect("VmSize in /proc/self/status");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Sets the soft address-space limit (RLIMIT_AS) to `bytes`
/// (`libc::RLIM_INFINITY` lifts it); the hard limit, which the system may
/// set, stays.
pub fn set_address_space_limit(bytes: u64) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: r is a valid rlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) }, 0);
    assert!(r.rlim_max == libc::RLIM_INFINITY || r.rlim_max >= bytes, "a hard limit below the test's: {}", r.rlim_max);
    r.rlim_cur = bytes;
    // SAFETY: a valid rlimit; moving the soft limit up to the hard one
    // needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &r) }, 0);
}

/// One `rdmasafe_get_event` on `ch` with the address space limited to
/// `headroom` bytes above what the process uses now; the limit is lifted
/// before this returns. Returns the get's result, errno as the get left
/// it, and the event pointer it wrote (null if none).
pub fn get_with_headroom(ch: &mut rdma_event_channel, headroom: u64) -> (c_int, c_int, *mut rdma_cm_event) {
    set_address_space_limit(vm_size() + headroom);
    let mut ev = std::ptr::null_mut();
    // SAFETY: a live stand-in channel; ev is writable.
    let rc = unsafe { rdmasafe::rdmasafe_get_event(ch, &mut ev) };
    let errno = rdmasafe_core::sys::errno_raw();
    set_address_space_limit(libc::RLIM_INFINITY);
    (rc, errno, ev)
}

/// Waits until `count` is above `n`, at most `patience`; the count then.
fn count_above(count: &AtomicUsize, n: usize, patience: Duration) -> usize {
    let end = Instant::now() + patience;
    while count.load(Relaxed) <= n && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    count.load(Relaxed)
}

/// Log lines "held past its ack deadline" seen by [`count_lines`].
static LATE_LINES: AtomicUsize = AtomicUsize::new(0);
/// Log lines saying the CM ack thread's state has no wipe-on-fork page.
pub static NO_WIPE_LINES: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn count_lines(_ctx: *mut std::os::raw::c_void, _level: c_int, msg: *const std::os::raw::c_char) {
    // SAFETY: msg is a NUL-terminated string for the call's duration.
    let msg = unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy();
    if msg.contains("held past its ack deadline") {
        LATE_LINES.fetch_add(1, Relaxed);
    }
    if msg.contains("no wipe-on-fork page") {
        NO_WIPE_LINES.fetch_add(1, Relaxed);
    }
}

/// The parent starts the ack-deadline thread (20 ms deadline, an original
/// held past it, warned of at warn level), then forks; the child gets a
/// copy and holds it: its original must be acked at the deadline, by a
/// thread of the child's, and warned of in the child as well (the first
/// in that process). Logs at debug level (see [`NO_WIPE_LINES`]). Installs
/// the stand-in pair: call first, one call per process.
pub fn forked_child_keeps_the_deadline() {
    install_calls();
    let (mut ch, w) = channel();
    rdmasafe::rdmasafe_cm_set_ack_deadline(20);
    assert_eq!(rdmasafe::rdmasafe_set_log_callback(Some(count_lines), std::ptr::null_mut()), 0);
    assert_eq!(rdmasafe::rdmasafe_set_log_level(4), 0, "debug");
    // The parent holds an original past its deadline: the thread runs.
    let ev = get_copy(&mut ch, w);
    assert_eq!(count_above(&ACKS, 0, Duration::from_secs(60)), 1, "the parent's original acked at the deadline");
    assert_eq!(count_above(&LATE_LINES, 0, Duration::from_secs(60)), 1, "the parent's late ack warned of");
    // SAFETY: the copy got above, freed once.
    assert_eq!(unsafe { rdmasafe::rdmasafe_event_free(ev) }, 0);

    // SAFETY: the child runs only the closure below, then _exit (never
    // back into the test harness).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let before = ACKS.load(Relaxed);
            let ev = get_copy(&mut ch, w);
            let after = count_above(&ACKS, before, Duration::from_secs(20));
            let warned = count_above(&LATE_LINES, 1, Duration::from_secs(20)) > 1;
            // SAFETY: the copy got above, freed once.
            unsafe { rdmasafe::rdmasafe_event_free(ev) };
            match (after > before, warned) {
                (true, true) => 0,
                (false, _) => 1,
                (true, false) => 3,
            }
        }))
        .unwrap_or(2);
        // SAFETY: ends the child without running the parent's exit work.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: our child; status is writable.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child ended by signal: status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's held original acked at the deadline and warned of (1: not acked within 20 s; 2: the child \
         panicked; 3: acked, no warning within 20 s)"
    );
}

/// Makes every later `madvise(..., MADV_WIPEONFORK)` of the calling thread
/// (and of the threads and children it makes later) fail with EINVAL, as
/// on a kernel before 4.14: a seccomp filter (no privilege needed after
/// `no_new_privs`).
pub fn refuse_wipe_on_fork() {
    use libc::{sock_filter, sock_fprog, BPF_ABS, BPF_JEQ, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W};
    const fn stmt(code: u32, k: u32) -> sock_filter {
        sock_filter { code: code as u16, jt: 0, jf: 0, k }
    }
    const fn jump(code: u32, k: u32, jt: u8, jf: u8) -> sock_filter {
        sock_filter { code: code as u16, jt, jf, k }
    }
    // seccomp_data: nr at 0, arch at 4, ip at 8, args[i] at 16 + 8 i; the
    // low half of args[2] (the advice) comes first on a little-endian CPU.
    const ADVICE: u32 = if cfg!(target_endian = "little") { 32 } else { 36 };
    let prog = [
        stmt(BPF_LD | BPF_W | BPF_ABS, 0),
        jump(BPF_JMP | BPF_JEQ | BPF_K, libc::SYS_madvise as u32, 0, 3),
        stmt(BPF_LD | BPF_W | BPF_ABS, ADVICE),
        jump(BPF_JMP | BPF_JEQ | BPF_K, libc::MADV_WIPEONFORK as u32, 0, 1),
        stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ERRNO | libc::EINVAL as u32),
        stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ALLOW),
    ];
    let fprog = sock_fprog { len: prog.len() as u16, filter: prog.as_ptr().cast_mut() };
    // SAFETY: plain prctl calls; fprog points to a live filter for the
    // call's duration (the kernel copies it).
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0, "no_new_privs");
        assert_eq!(
            libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &fprog as *const sock_fprog),
            0,
            "seccomp filter: {}",
            std::io::Error::last_os_error()
        );
    }
    // The filter holds: a fresh page cannot be marked.
    // SAFETY: an anonymous mapping at an address the kernel picks, marked,
    // then unmapped once.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let rc = libc::madvise(p, 4096, libc::MADV_WIPEONFORK);
        let errno = rdmasafe_core::sys::errno_raw();
        libc::munmap(p, 4096);
        assert_eq!((rc, errno), (-1, libc::EINVAL), "MADV_WIPEONFORK refused");
    }
}
