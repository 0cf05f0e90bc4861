//! A C thread cancelled (`pthread_cancel`) in `rdmasafe_get_event` while
//! another thread's get is starting the CM ack-deadline thread: the
//! cancellation is acted on at the get's own cancellable wait, never at
//! the 1 ms sleep the get makes while it waits for that start, or for the
//! set-up of the copies' storage that the other get has under way (a
//! cancellation point inside frames that catch panics, where glibc's
//! forced unwind ends the process: "FATAL: exception not rethrown";
//! SIGABRT in 27 and 31 of 1,000 trials before the start's wait was fixed,
//! found by a review, and in 4 of 1,000 in CI, 5 to 11 of 1,000 on a
//! quiet host, before the storage's wait was). Each
//! trial is a fresh process (the thread starts once per process): thread B
//! gets (default deadline: it starts the ack thread), and thread A, made a
//! few microseconds later, cancels itself (pending) and gets. librdmacm's
//! two calls are replaced by the stand-in pair. `harness = false`: the
//! main thread forks.

mod standin;

use std::os::raw::c_void;
use std::time::{Duration, Instant};

use rdmasafe::{rdmasafe_event_free, rdmasafe_get_event};
use rdmasafe_core::sys::rdma_event_channel;

const TRIALS: u64 = 1000;

extern "C-unwind" fn cancelled_get(ch: *mut c_void) -> *mut c_void {
    // SAFETY: cancels this very thread: pending until its next
    // cancellation point.
    unsafe { libc::pthread_cancel(libc::pthread_self()) };
    let mut ev = std::ptr::null_mut();
    // SAFETY: a live stand-in channel; ev is writable.
    if unsafe { rdmasafe_get_event(ch.cast(), &mut ev) } == 0 {
        // SAFETY: the copy just got, freed once.
        unsafe { rdmasafe_event_free(ev) };
    }
    std::ptr::null_mut()
}

/// One trial, in a forked child; never returns.
fn trial(spin: Duration) -> ! {
    standin::install_calls();
    let (ch, w) = standin::channel();
    standin::ready(w);
    standin::ready(w);
    let ch = Box::into_raw(ch) as usize;
    let b = std::thread::spawn(move || {
        let mut ev = std::ptr::null_mut();
        // SAFETY: a live stand-in channel; ev is writable.
        if unsafe { rdmasafe_get_event(ch as *mut rdma_event_channel, &mut ev) } == 0 {
            // SAFETY: the copy just got, freed once.
            unsafe { rdmasafe_event_free(ev) };
        }
    });
    let t = Instant::now();
    while t.elapsed() < spin {}
    let mut a: libc::pthread_t = 0;
    let f: extern "C-unwind" fn(*mut c_void) -> *mut c_void = cancelled_get;
    // SAFETY: a valid start routine (the C-unwind ABI is the C one for
    // pthread_create, which lets a cancellation unwind through it) and arg.
    let rc = unsafe {
        libc::pthread_create(
            &mut a,
            std::ptr::null(),
            std::mem::transmute::<
                extern "C-unwind" fn(*mut c_void) -> *mut c_void,
                extern "C" fn(*mut c_void) -> *mut c_void,
            >(f),
            ch as *mut c_void,
        )
    };
    assert_eq!(rc, 0);
    // SAFETY: a joinable thread made above.
    unsafe { libc::pthread_join(a, std::ptr::null_mut()) };
    b.join().unwrap();
    // SAFETY: ends the child without running the parent's atexit handlers.
    unsafe { libc::_exit(0) }
}

fn main() {
    let (mut aborted, mut other) = (0, Vec::new());
    for k in 0..TRIALS {
        // SAFETY: this process has one thread (harness = false): the child
        // may do anything.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            trial(Duration::from_micros(k % 20));
        }
        let mut st = 0;
        // SAFETY: our child; st is writable.
        assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
        if libc::WIFSIGNALED(st) && libc::WTERMSIG(st) == libc::SIGABRT {
            aborted += 1;
        } else if !(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0) {
            other.push(st);
        }
    }
    assert_eq!(aborted, 0, "{aborted} of {TRIALS} trials ended in SIGABRT");
    assert!(other.is_empty(), "trials ended otherwise: {other:x?}");
    println!("a_get_cancelled_while_the_ack_thread_starts_is_no_abort: {TRIALS} trials: ok");
}
