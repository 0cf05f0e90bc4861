//! Connection manager events: copy into storage rdmasafe owns, hand the
//! copy out, ack librdmacm's original at the right time.
//!
//! * [`EventChannel`]: an event channel rdmasafe created and owns (its fd is
//!   non-blocking; ids made on it carry their [`IdToken`] as context).
//!   Originals are acked as soon as they are copied: holding a copy never
//!   delays dropping an id.
//! * [`ChannelRef`]: a channel the application owns; rdmasafe never changes
//!   its blocking mode and never takes ownership of ids on it. Originals
//!   are acked when the copy is dropped or after [`ack_deadline`]: the
//!   destroy barrier of librdmacm, bounded (what the C API uses).
//! * [`CmEvent`]: an owned copy.
//! * [`CmId`], [`ConnectRequest`]: owned ids; dropping destroys them.
//! * [`Dispatcher`]: a thread that gets, copies and acks, and feeds a
//!   callback or worker threads through a bounded lock-free queue.

mod channel;
mod dispatch;
mod event;
mod id;
pub(crate) mod pool;

pub use channel::{ChannelRef, EventChannel};
pub use dispatch::{Dispatcher, DispatcherStats, StopHandle, WorkQueue};
pub use event::{copy_synthetic, CmEvent, ConnParam, EventType, SyntheticEvent, UdParam};
pub use id::{CmId, ConnectParams, ConnectRequest, IdToken, PortSpace, QpCaps, SendOptions};
pub use pool::{
    ack_deadline, ack_deadline_env, after_fork_in_child, capacity, counters, limit, reserve, set_ack_deadline,
    set_limit, CopyDestination, Counters, DEFAULT_ACK_DEADLINE, FREE_LIST_CAPACITY, MAX_SLOTS, QUARANTINE,
};

/// The devices librdmacm uses now (`rdma_get_devices`), by name. The call
/// also makes librdmacm notice removed devices: after
/// RDMA_CM_EVENT_DEVICE_REMOVAL it marks a removed device dead and closes
/// its context once the last reference to it is released (rdma-core v30+
/// does that only here or on an address lookup that misses).
pub fn devices() -> crate::Result<Vec<String>> {
    let mut n = 0;
    // SAFETY: plain call; the NULL-terminated list is ours to free.
    let list = unsafe { crate::sys::rdma_get_devices(&mut n) };
    if list.is_null() {
        return Err(crate::Error::last("rdma_get_devices"));
    }
    let names = (0..n.max(0) as usize)
        // SAFETY: n live contexts in the list, each with a live device.
        .map(|i| unsafe { std::ffi::CStr::from_ptr(crate::sys::ibv_get_device_name((**list.add(i)).device)) })
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    // SAFETY: freed once, here.
    unsafe { crate::sys::rdma_free_devices(list) };
    Ok(names)
}

/// Serialises the unit tests that make copies (each ages the quarantine)
/// or depend on which slot the pool hands out: every one holds it.
#[cfg(test)]
pub(crate) fn tests_lock() -> std::sync::MutexGuard<'static, ()> {
    static L: std::sync::Mutex<()> = std::sync::Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}
