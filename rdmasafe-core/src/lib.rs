//! rdmasafe-core: RDMA connection-manager events and completion-queue
//! notification, done right, over librdmacm and libibverbs.
//!
//! RDMA programs get two event paths wrong again and again: CM events that
//! are acked too early (their private data dangles) or never (teardown
//! hangs in `rdma_destroy_id`), and CQ notification loops that sleep while a
//! completion waits, ack the wrong CQ, or never ack (teardown hangs in
//! `ibv_destroy_cq`). This crate runs both paths for you.
//!
//! # CM events
//!
//! An [`cm::EventChannel`] copies every event into storage rdmasafe owns
//! and acks librdmacm's original before you see it: a [`cm::CmEvent`] is
//! plain owned data (private data, connection and UD parameters, the id by
//! [`cm::IdToken`]) that you may keep, queue or send to another thread, and
//! dropping a [`cm::CmId`] never waits for it. A connect request you drop
//! without accepting is rejected and its id destroyed.
//!
//! ```no_run
//! use rdmasafe_core::cm::{ConnectParams, EventChannel, EventType, PortSpace};
//!
//! let ch = EventChannel::new()?;
//! let listener = ch.create_id(PortSpace::Tcp)?;
//! listener.bind_addr("10.77.0.1:7471".parse().unwrap())?;
//! listener.listen(64)?;
//! let mut ev = ch.get()?; // copied and acked already
//! if ev.event_type() == EventType::CONNECT_REQUEST {
//!     let hello = ev.private_data().to_vec(); // owned bytes (padded length)
//!     let req = ev.take_request().unwrap(); // the new id, owned
//!     let _conn = req.accept(&ConnectParams { private_data: &hello[..4], ..Default::default() })?;
//! }
//! # Ok::<(), rdmasafe_core::Error>(())
//! ```
//!
//! # The CQ loop
//!
//! A [`cq::CqLoop`] serves one [`verbs::CompChannel`] and any number of CQs
//! on it, each with a handler that gets batches of [`verbs::Wc`] (errors
//! included, each completion exactly once): arm, wait, get, ack to the CQ
//! the event names (batched), re-arm *before* the final drain, in event,
//! busy-poll, adaptive (fixed spin) or learning mode. CQs come and go while it runs, from any
//! thread ([`cq::LoopControl`]) or from a handler. It runs on your thread
//! ([`cq::CqLoop::run`], [`cq::CqLoop::run_for`]), on its own
//! ([`cq::CqLoop::spawn`]), or one cycle at a time from your own epoll
//! ([`cq::CqLoop::process_once`] on its fd). [`cq::LocalCqLoop`] is the
//! same for one thread, with handlers that need not be `Send`.
//! [`cq::CqLoop::drain_id`] waits until everything posted on an id's QP
//! completed; [`cq::CqLoop::add_keepalive_id`] declares a silent peer dead.
//!
//! ```no_run
//! use rdmasafe_core::cq::{CqLoop, LoopOptions};
//! use rdmasafe_core::verbs::{CompChannel, Cq, DeviceContext};
//!
//! fn serve(ctx: &DeviceContext) -> rdmasafe_core::Result<()> {
//!     let chan = CompChannel::new(ctx)?;
//!     let cq = Cq::new(ctx, 256, Some(&chan))?; // give it to your QPs
//!     let lp = CqLoop::new(&chan, LoopOptions::default())?;
//!     lp.add_cq(&cq, |wcs, ctl| {
//!         for wc in wcs {
//!             if !wc.is_success() {
//!                 eprintln!("{}: {}", wc.wr_id(), wc.status());
//!                 ctl.stop();
//!             }
//!         }
//!     })?;
//!     lp.run() // until a stop; every ack flushed on return
//! }
//! ```
//!
//! # Data path
//!
//! [`verbs`] keeps what a test or a small app needs: PDs, memory regions
//! (rdmasafe's or the app's own, [`verbs::Mr::from_box`]), and on a
//! [`cm::CmId`]'s QP: SEND / RECV, SEND with immediate, inline SEND, RDMA
//! WRITE (with immediate) and READ ([`verbs::RemoteMr`]), signalled or
//! not. For a full data path, pair rdmasafe with a verbs crate (next
//! section).
//!
//! # Interop with sideway
//!
//! With the `sideway` feature, the `sideway` module joins the
//! [sideway](https://docs.rs/sideway/0.4) verbs crate to rdmasafe:
//! sideway's completion channels and CQs run in a [`cq::CqLoop`]
//! (`sideway::CompletionLoop`), and sideway's QPs connect through
//! rdmasafe's [`cm::CmId`]s (`sideway::Qp::connect` / `accept`, by
//! `rdma_init_qp_attr`), so sideway does the data path (`ibv_wr_*` RDMA
//! WRITE with immediate, READ, atomics) with no raw pointer in your code.
//! docs/interop.md says why sideway (and not rust-ibverbs) and how.
//!
//! # Async
//!
//! With the `tokio` feature, `aio` runs the CM channel and the CQ loop on
//! a tokio runtime: `aio::AsyncEventChannel::next` awaits the next owned
//! event, `aio::AsyncCqLoop` runs the loop as a future or a task (woken by
//! the loop's fd and its next deadline, never a polling timer), and
//! `aio::drain_id` / `aio::remove_cq` are futures that never block the
//! runtime. With `mio`, [`cm::EventChannel`] and [`cq::CqLoop`] are
//! `mio::event::Source`s for any runtime or a hand-made poll loop, driven
//! with [`cm::EventChannel::try_get`] and [`cq::CqLoop::process_ready`]
//! (edge-triggered: until nothing is ready). Both keep every guarantee of
//! the blocking paths: they run the same code one non-blocking step at a
//! time. `examples/rxe_async_echo.rs` is an echo server with many clients.
//!
//! # Errors, logging, raw access
//!
//! Every fallible call returns [`Error`]: the call that failed, its errno,
//! optionally what you were doing ([`Error::context`]). rdmasafe logs
//! through the [`log`](https://docs.rs/log) facade (target `rdmasafe`):
//! pick any backend; trace level logs every CM event copied and every CQ
//! wakeup, and with the level off a log site costs one atomic load. The
//! C library installs its own backend (RDMASAFE_LOG, a C callback).
//! Raw pointers are reachable where interop needs them (`raw()` getters,
//! `unsafe` constructors from raw objects); [`sys`] is the FFI layer the C
//! library uses and is not part of the stable API.
//!
//! # Threads and signals
//!
//! The threads rdmasafe starts on its own (the CM ack-deadline thread,
//! started by the first get; its log writer, which hands the ack thread's
//! lines to your `log` backend; the one that waits for a loop thread let
//! go of from its own handler) block every signal: a signal
//! sent to the process reaches one of your threads, as without rdmasafe.
//! The threads you ask for ([`cq::CqLoop::spawn`],
//! [`cm::Dispatcher`], [`cq::AsyncEvents::spawn`]) run your callbacks and
//! inherit the calling thread's mask, as `std::thread::spawn`'s do.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

#[cfg(feature = "tokio")]
pub mod aio;
pub mod cm;
pub mod cq;
pub mod error;
#[cfg(feature = "mio")]
mod mio_source;
#[cfg(feature = "sideway")]
pub mod sideway;
#[doc(hidden)]
pub mod sys;
pub mod verbs;
mod wait;
mod wc;

pub use error::{Error, Result};
pub use wait::Wait;

/// The README's code blocks, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
