//! A loop on a thread of its own.

use super::event_loop::{CqLoop, LoopThread};
use crate::sys;
use crate::{Error, Result};

/// Starts a thread that runs `lp`, optionally pinned to `cpu`.
pub(crate) fn spawn(lp: CqLoop, cpu: Option<usize>) -> Result<LoopThread> {
    let ctl = lp.control();
    let thread = std::thread::Builder::new()
        .name("rdmasafe-cq".into())
        .spawn(move || {
            let pinned = cpu.map(sys::pin_current_thread).transpose();
            let r = pinned
                .map_err(|e| Error::new("sched_setaffinity", e.raw_os_error().unwrap_or(libc::EINVAL)))
                .and_then(|_| lp.run());
            (lp, r)
        })
        .map_err(|e| Error::new("pthread_create", e.raw_os_error().unwrap_or(libc::EAGAIN)))?;
    Ok(LoopThread { ctl, thread: Some(thread) })
}
