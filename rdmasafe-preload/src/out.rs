//! Where the preload's words go: its log (the `log` facade, to stderr at
//! the level RDMASAFE_LOG names, off by default, as with librdmasafe) and
//! check mode's reports (always, to stderr or to the file
//! RDMASAFE_CHECK_FILE names, appended, one line per write).

use std::fs::File;
use std::io::Write;

use rdmasafe_core::sys::fork_once::ForkOnce;

use log::{LevelFilter, Log, Metadata, Record};
use rdmasafe_core::sys::cancel::CancelDisabled;

struct StderrLog;

impl Log for StderrLog {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &Record<'_>) {
        if self.enabled(r.metadata()) {
            let _no_cancel = CancelDisabled::new();
            let line = format!("rdmasafe[{}]: {}\n", r.level(), r.args());
            to_stderr(line.as_bytes());
        }
    }

    fn flush(&self) {}
}

static LOGGER: StderrLog = StderrLog;

/// Writes `line` to fd 2, in one write(2) if it can (a closed or broken
/// stderr loses it). Not through `std::io::stderr()`, whose lock a thread
/// holds across a write that may block (a full pipe): a child forked
/// meanwhile would inherit that lock taken, by a thread it does not have,
/// and hang at its first line.
fn to_stderr(mut line: &[u8]) {
    while !line.is_empty() {
        // SAFETY: writes from a live buffer of `line.len()` bytes.
        let r = unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
        match r {
            n if n > 0 => line = &line[n as usize..],
            n if n < 0 && rdmasafe_core::sys::errno() == libc::EINTR => {}
            _ => return,
        }
    }
}

/// RDMASAFE_LOG's value as a level (error|warn|info|debug|trace; off, 0 or
/// empty: off); `None` for anything else (librdmasafe takes that as off).
pub(crate) fn parse_level(s: &str) -> Option<LevelFilter> {
    Some(match s.trim().to_ascii_lowercase().as_str() {
        "error" => LevelFilter::Error,
        "warn" | "warning" => LevelFilter::Warn,
        "info" => LevelFilter::Info,
        "debug" => LevelFilter::Debug,
        "trace" => LevelFilter::Trace,
        "" | "off" | "0" => LevelFilter::Off,
        _ => return None,
    })
}

/// Installs the stderr logger of this library (its own copy of the `log`
/// facade: the program's logging, if any, is not affected).
pub(crate) fn install_logger() {
    // Installed already: by a set-up of the parent that a fork left under
    // way (see `rdmasafe_core::sys::fork_once`); the level is set again.
    let _ = log::set_logger(&LOGGER);
    let value = std::env::var("RDMASAFE_LOG").unwrap_or_default();
    let level = parse_level(&value).unwrap_or_else(|| {
        setup_error(&format!("RDMASAFE_LOG={value:?} is none of error, warn, info, debug, trace, off: logging off"));
        LevelFilter::Off
    });
    log::set_max_level(level);
}

/// Says on stderr, whatever the log level (logging is off unless
/// RDMASAFE_LOG sets a level), that the preload cannot do what it was asked
/// to do and what it does instead: `rdmasafe-preload[PID COMM]: TEXT`.
pub(crate) fn setup_error(text: &str) {
    let _no_cancel = CancelDisabled::new();
    to_stderr(format!("rdmasafe-preload[{}]: {text}\n", who()).as_bytes());
}

/// The process's pid and command name, for report lines (several
/// processes may append to one report file).
pub(crate) fn who() -> String {
    let comm = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
    format!("{} {}", std::process::id(), comm.trim())
}

static REPORT_FILE: ForkOnce<Option<File>> = ForkOnce::new();

/// Emits one check-mode report line:
/// `rdmasafe-check[PID COMM]: KIND: TEXT`.
pub(crate) fn report(kind: &str, text: &str) {
    // Its open() and write() may be cancellation points: one acted on
    // here would unwind through rdmasafe's frames, which ends the process
    // (the same in the two functions above).
    let _no_cancel = CancelDisabled::new();
    let line = format!("rdmasafe-check[{}]: {kind}: {text}\n", who());
    match open_report_file() {
        Some(f) => {
            let mut f: &File = f;
            let _ = f.write_all(line.as_bytes());
        }
        None => to_stderr(line.as_bytes()),
    }
}

/// In a forked child: an opening of the report file that another thread
/// of the parent had under way (a FIFO waits for its reader) is forgotten;
/// the child opens it again at its first report.
///
/// # Safety
/// Only from a fork child handler (the child has one thread then).
pub(crate) unsafe fn after_fork_in_child() {
    // SAFETY: the caller's contract.
    unsafe { REPORT_FILE.after_fork_in_child(false) };
}

/// The report file RDMASAFE_CHECK_FILE names, opened at the first report;
/// `None`: reports go to stderr.
fn open_report_file() -> Option<&'static File> {
    let _no_cancel = CancelDisabled::new();
    REPORT_FILE
        .get_or_init(|| {
            let path = std::env::var_os("RDMASAFE_CHECK_FILE").filter(|p| !p.is_empty())?;
            match std::fs::OpenOptions::new().append(true).create(true).open(&path) {
                Ok(f) => Some(f),
                Err(e) => {
                    let msg = format!(
                        "rdmasafe-check[{}]: cannot open RDMASAFE_CHECK_FILE {path:?} ({e}); reporting to stderr\n",
                        who()
                    );
                    to_stderr(msg.as_bytes());
                    None
                }
            }
        })
        .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_like_librdmasafe() {
        assert_eq!(parse_level(" Info "), Some(LevelFilter::Info));
        assert_eq!(parse_level("warning"), Some(LevelFilter::Warn));
        assert_eq!(parse_level("2"), None, "refused (librdmasafe: off)");
        assert_eq!(parse_level(""), Some(LevelFilter::Off));
        assert_eq!(parse_level("OFF"), Some(LevelFilter::Off));
    }
}
