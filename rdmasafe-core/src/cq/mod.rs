//! Completion queue notification, done right: see [`CqLoop`].
//!
//! * [`CqLoop`]: one completion channel, many CQs, three modes, batched
//!   acks to the CQ each event names, re-arm before the final drain, stop
//!   from anywhere, figures readable at any time ([`LoopStats`]).
//! * [`AsyncEvents`]: copies and acks a device's async events at once and
//!   hands out the copies, each with the CQ / QP / SRQ / port it concerns.

mod async_events;
mod event_loop;
mod stats;

pub use async_events::{AsyncElement, AsyncEvent, AsyncEventType, AsyncEvents};
pub use event_loop::{
    CqLoop, DeadPeer, Handler, Keepalive, LoopControl, LoopOptions, LoopThread, Mode, DRAIN_RECV_WR_ID,
    DRAIN_SEND_WR_ID,
};
pub use stats::{LoopStats, BUCKETS};
