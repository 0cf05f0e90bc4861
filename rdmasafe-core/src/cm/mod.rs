//! Connection manager events: copy, ack at once, hand the copy out.
//!
//! * [`EventChannel`]: an event channel rdmasafe created and owns (its fd is
//!   non-blocking; ids made on it carry their [`IdToken`] as context).
//! * [`ChannelRef`]: a channel the application owns; rdmasafe never changes
//!   its blocking mode and never takes ownership of ids on it.
//! * [`CmEvent`]: an owned copy. librdmacm's event is already acked.
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
pub use event::{copy_synthetic, CmEvent, ConnParam, EventType, UdParam};
pub use id::{CmId, ConnectParams, ConnectRequest, IdToken, PortSpace, QpCaps};
pub use pool::{counters, reserve, Counters, FREE_LIST_CAPACITY};
