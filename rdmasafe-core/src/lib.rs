//! rdmasafe-core: safe handling of RDMA CM events and CQ notifications.
//!
//! * [`cm`]: every CM event is copied into storage rdmasafe owns and acked
//!   before the caller sees it; holding a copy can never block
//!   `rdma_destroy_id`.
//! * [`verbs`]: owned PD / MR / CQ / completion channel handles.
//! * [`sys`]: the one raw FFI layer.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod cm;
pub mod cq;
pub mod error;
pub mod log;
pub mod sys;
pub mod verbs;

pub use error::{Error, Result};

/// The README's code blocks, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
