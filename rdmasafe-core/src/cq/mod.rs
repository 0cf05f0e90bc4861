//! Completion queue notification, done right: see [`CqLoop`].
//!
//! * [`CqLoop`]: one completion channel, many CQs, four modes, batched
//!   acks to the CQ each event names, re-arm before the final drain, CQs
//!   added and removed while it runs (from any thread, or from a handler),
//!   per-CQ options (solicited-only, a per-cycle budget), an fd for the
//!   app's own epoll, stop from anywhere (a signal handler included),
//!   figures readable at any time ([`LoopStats`]).
//! * [`LoopControl`]: what any thread can do to a running loop.
//! * [`AsyncEvents`]: copies and acks a device's async events at once and
//!   hands out the copies, each with the CQ / QP / SRQ / port it concerns.
//!
//! Files, one idea each: `options` (what can be set), `handle` (the verbs
//! objects, the only `unsafe` of the loop), `entries` (the CQs of a loop),
//! `control` (changes from any thread), `core` (the loop's state: acks,
//! events, draining into handlers), `cycle` (the cycle per mode), `timers`
//! (deadlines), `fast` (event mode's common wakeup in one frame),
//! `event_loop` (the public [`CqLoop`]), `keepalive`,
//! `drain`, `thread`, `registry`, `run_state` (who runs the loop, or
//! whether it is closed), `stats`, `async_events`.

mod async_events;
mod control;
mod core;
mod cycle;
mod drain;
mod entries;
mod event_loop;
mod fast;
pub(crate) mod handle;
mod keepalive;
mod learn;
mod local;
mod options;
mod registry;
mod run_state;
mod stats;
mod thread;
mod timers;

pub use crate::wc::{Wc, WcOpcode, WcStatus};
pub use async_events::{AsyncElement, AsyncEvent, AsyncEventType, AsyncEvents, AsyncThread};
#[cfg(feature = "tokio")]
pub(crate) use control::NOT_POLLED_YET;
pub use control::{LoopControl, Outcome};
pub use drain::{cq_destroyed, cq_destroying, LeftWith, DRAIN_RECV_WR_ID, DRAIN_SEND_WR_ID};
#[cfg(feature = "tokio")]
pub(crate) use event_loop::RunClaim;
pub use event_loop::{CqLoop, LoopThread, Progress, RunEnd};
pub use learn::MAX_LATENCY_WEIGHT;
pub use local::{LocalControl, LocalCqLoop, StopHandle};
pub use options::{CqOptions, Keepalive, LoopOptions, Mode};
pub use stats::{LoopStats, BUCKETS};

/// A CQ's handler: gets each batch of work completions (error completions
/// included, never dropped) and the loop's control. It runs on the thread
/// that runs the loop; it may change the loop through the control (changes
/// take effect when it returns) and must not block on a thread that waits
/// for this loop.
pub type Handler = Box<dyn FnMut(&[Wc], &LoopControl) + Send>;

/// Called once when a keepalive declares a QP's peer dead, after the QP was
/// moved to the error state; gets the QP number.
pub type DeadPeer = Box<dyn FnMut(u32, &LoopControl) + Send>;
