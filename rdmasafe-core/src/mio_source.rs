//! `mio::event::Source` for the CM event channel and the CQ loop (the
//! `mio` feature): register them with a `mio::Poll` (or anything built on
//! it) like a socket.
//!
//! mio is edge-triggered. On a readable event:
//!
//! * [`EventChannel`]: call [`EventChannel::try_get`] until it returns
//!   `Ok(None)` (the channel is empty; the next event raises a new edge,
//!   and so does an id migrated into the channel with
//!   [`CmId::migrate`](crate::cm::CmId::migrate), whose queued events the
//!   kernel moves without an edge on the channel's fd: the registration
//!   watches an eventfd of rdmasafe's beside it, under the same token).
//! * [`CqLoop`]: call [`CqLoop::process_ready`] while it reports
//!   [`Progress::more`](crate::cq::Progress); and give `Poll::poll` at most
//!   [`CqLoop::next_timeout`] as its timeout (the loop's fd also becomes
//!   readable at its deadlines, through a timerfd, so `None` works too).
//!
//! ```no_run
//! use mio::{Events, Interest, Poll, Token};
//! use rdmasafe_core::cm::EventChannel;
//!
//! let mut poll = Poll::new()?;
//! let mut ch = EventChannel::new()?;
//! poll.registry().register(&mut ch, Token(0), Interest::READABLE)?;
//! let mut events = Events::with_capacity(8);
//! poll.poll(&mut events, None)?;
//! while let Some(ev) = ch.try_get()? {
//!     println!("{}", ev.event_type());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io;
use std::os::fd::AsRawFd;

use mio::event::Source;
use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};

use crate::cm::EventChannel;
use crate::cq::CqLoop;

/// Registers the channel's fd (non-blocking already): readable when an
/// event is ready; and, under the same token, the channel's moved-in
/// eventfd, which [`CmId::migrate`](crate::cm::CmId::migrate) into the
/// channel makes readable (its moved events raise no edge on the
/// channel's fd). `register` fails with the error of `eventfd(2)`
/// (EMFILE, ...) if that eventfd cannot be made.
impl Source for EventChannel {
    fn register(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
        let moved_in = self.inner.moved_in()?.fd();
        SourceFd(&self.as_raw_fd()).register(registry, token, interests)?;
        SourceFd(&moved_in).register(registry, token, Interest::READABLE).inspect_err(|_| {
            let _ = SourceFd(&self.as_raw_fd()).deregister(registry);
        })
    }

    fn reregister(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
        SourceFd(&self.as_raw_fd()).reregister(registry, token, interests)?;
        SourceFd(&self.inner.moved_in()?.fd()).reregister(registry, token, Interest::READABLE)
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        SourceFd(&self.as_raw_fd()).deregister(registry)?;
        SourceFd(&self.inner.moved_in()?.fd()).deregister(registry)
    }
}

/// Registers the loop's own epoll fd (not the completion channel's):
/// readable whenever the loop has work (a CQ event, a change or stop from
/// another thread, a deadline).
impl Source for CqLoop {
    fn register(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
        SourceFd(&self.as_raw_fd()).register(registry, token, interests)
    }

    fn reregister(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
        SourceFd(&self.as_raw_fd()).reregister(registry, token, interests)
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        SourceFd(&self.as_raw_fd()).deregister(registry)
    }
}
