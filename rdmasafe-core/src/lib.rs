//! rdmasafe-core: safe handling of RDMA CM events and CQ notifications.
//!
//! * [`cm`]: every CM event is copied into storage rdmasafe owns and acked
//!   before the caller sees it; holding a copy can never block
//!   `rdma_destroy_id`.
//! * [`verbs`]: owned PD / MR / CQ / completion channel handles.
//! * [`sys`]: the one raw FFI layer.
//! * `sideway` (feature `sideway`): the sideway verbs crate's CQs in the CQ
//!   loop and its QPs connected through rdmasafe's CM ids, without raw
//!   pointers in user code (docs/interop.md).
//!
//! Logging goes through the [`log`](https://docs.rs/log) facade (target
//! `rdmasafe`): pick any backend (`env_logger`, `tracing-log`, ...). Trace
//! level logs every CM event copied and every CQ wakeup; with the level
//! off, a log site costs one atomic load and a branch. The C library
//! installs its own backend (RDMASAFE_LOG, `rdmasafe_set_log_callback`).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod cm;
pub mod cq;
pub mod error;
#[cfg(feature = "sideway")]
pub mod sideway;
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
