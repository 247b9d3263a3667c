//! Real-time scheduling for the node's thread: a peer's in-flight count is applied the moment
//! its datagram arrives, and this router's changes leave at once, instead of waiting for a
//! core behind the router's (or, on a shared machine, anyone's) busy threads. On this
//! project's 2-core bench machine the wait was most of the mesh's delay: envelope age p99
//! ≤ 1–2 ms at normal priority, ≤ 0.2 ms at real-time priority (BENCHMARKS.md, "The mesh").

use std::io;

/// Puts the calling thread under `SCHED_FIFO` at `priority` (1–99), reset on fork: threads
/// it starts (a runtime's blocking pool: DNS lookups) get normal scheduling. Linux only; needs
/// `CAP_SYS_NICE` or an `RLIMIT_RTPRIO` of at least `priority` (else `PermissionDenied`).
/// The thread must block between bursts of bounded work, as the node's runtime does: the
/// kernel's real-time throttling (by default 95% of each second) is the only bound on a
/// real-time thread that does not.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub fn raise_current_thread(priority: u8) -> io::Result<()> {
    if !(1..=99).contains(&priority) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "real-time priority must be between 1 and 99",
        ));
    }
    let param = libc::sched_param {
        sched_priority: i32::from(priority),
    };
    // SAFETY: `sched_setscheduler` reads the `sched_param` we pass by reference for the
    // duration of the call and nothing else; pid 0 is the calling thread.
    let r = unsafe {
        libc::sched_setscheduler(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, &param)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Not Linux: real-time scheduling is not asked for.
#[cfg(not(target_os = "linux"))]
pub fn raise_current_thread(_priority: u8) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "real-time scheduling is only asked for on Linux",
    ))
}

/// The calling thread runs under `SCHED_FIFO` (Linux; `false` elsewhere).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub fn current_thread_is_realtime() -> bool {
    // SAFETY: no arguments but the calling thread's pid (0); reads the thread's policy.
    let policy = unsafe { libc::sched_getscheduler(0) };
    policy & !libc::SCHED_RESET_ON_FORK == libc::SCHED_FIFO
}

/// The calling thread runs under `SCHED_FIFO` (Linux; `false` elsewhere).
#[cfg(not(target_os = "linux"))]
pub fn current_thread_is_realtime() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_is_raised_or_told_why_not() {
        // On a fresh thread, so the test runner's threads keep their scheduling.
        std::thread::spawn(|| {
            assert!(
                !current_thread_is_realtime(),
                "threads start at normal priority"
            );
            assert_eq!(
                raise_current_thread(0).unwrap_err().kind(),
                io::ErrorKind::InvalidInput
            );
            match raise_current_thread(1) {
                Ok(()) => {
                    assert!(current_thread_is_realtime());
                    // Reset on fork: a thread it starts is not real-time.
                    let child = std::thread::spawn(current_thread_is_realtime);
                    assert!(
                        !child.join().unwrap(),
                        "a child thread stays at normal priority"
                    );
                }
                Err(e) => {
                    // Unprivileged (or not Linux): refused, and the thread is as it was.
                    assert!(
                        matches!(
                            e.kind(),
                            io::ErrorKind::PermissionDenied | io::ErrorKind::Unsupported
                        ),
                        "{e}"
                    );
                    assert!(!current_thread_is_realtime());
                }
            }
        })
        .join()
        .unwrap();
    }
}
