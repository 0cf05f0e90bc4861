//! A child forked while another thread's get is committing memory for new
//! CM copy slots (its `mprotect`, under the storage's growth lock) makes
//! copies of its own: it takes that lock back from the thread it does not
//! have, instead of waiting for it for good (before: the child's first get
//! that needed a new slot hung, ended here by its alarm; found by a
//! review). This binary's own `mprotect`, which the library's call binds
//! to, holds the commit until the fork is done; librdmacm's two calls are
//! replaced by the stand-in pair. `harness = false`: the main thread
//! forks.

mod standin;

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::Duration;

use rdmasafe::rdmasafe_event_free;

/// Armed by the test: the next commit of a chunk of copy slots (readable
/// and writable, 64 KiB) says when it began, and waits for the fork.
static ARMED: AtomicBool = AtomicBool::new(false);
static SLOW_BEGAN: AtomicBool = AtomicBool::new(false);
/// Set in the parent when the fork is done (its fork handler).
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn forked() {
    FORKED.store(true, SeqCst);
}

/// `mprotect`, for every caller in this binary: a commit held until the
/// fork once armed (for at most 60 s), then the system call.
///
/// # Safety
/// As `mprotect(2)`.
#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int {
    if prot == libc::PROT_READ | libc::PROT_WRITE && len == 64 * 1024 && ARMED.swap(false, SeqCst) {
        SLOW_BEGAN.store(true, SeqCst);
        let patience = std::time::Instant::now() + Duration::from_secs(60);
        while !FORKED.load(SeqCst) && std::time::Instant::now() < patience {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // SAFETY: the caller's arguments, as mprotect(2) takes them.
    unsafe { libc::syscall(libc::SYS_mprotect, addr, len, prot) as c_int }
}

fn main() {
    // SAFETY: registers a parent handler that only stores a flag.
    assert_eq!(unsafe { libc::pthread_atfork(None, Some(forked), None) }, 0);
    standin::install_calls();
    let (mut ch, w) = standin::channel();
    ARMED.store(true, SeqCst);
    let ch_addr = &mut *ch as *mut _ as usize;
    let grower = std::thread::spawn(move || {
        // SAFETY: the channel lives until after the join below.
        let ev = standin::get_copy(unsafe { &mut *(ch_addr as *mut _) }, w);
        // SAFETY: the copy just got, freed once.
        unsafe { rdmasafe_event_free(ev) };
    });
    while !SLOW_BEGAN.load(SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: the child only gets and frees a copy, then _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        // SAFETY: a watchdog for the child: SIGALRM ends it if it hangs.
        unsafe { libc::alarm(10) };
        // Its first get needs a new slot: the parent's grower has not
        // finished making the first one.
        let ev = standin::get_copy(&mut ch, w);
        // SAFETY: the copy just got, freed once.
        unsafe { rdmasafe_event_free(ev) };
        // SAFETY: ends the child without the parent's atexit handlers.
        unsafe { libc::_exit(0) }
    }
    let mut st = 0;
    // SAFETY: our child; st is writable.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    grower.join().unwrap();
    assert!(
        libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
        "the child did not get its copy: {} {}",
        if libc::WIFSIGNALED(st) { "signal" } else { "exit status" },
        if libc::WIFSIGNALED(st) { libc::WTERMSIG(st) } else { libc::WEXITSTATUS(st) }
    );
    println!("a_child_forked_while_the_storage_grows_makes_its_own_copies: ok");
}
