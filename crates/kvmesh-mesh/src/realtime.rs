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

// Linux: the thread's policy is read back from /proc, apart from the call that set it.
#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The calling thread's scheduling policy is `SCHED_FIFO`, as `/proc/thread-self/stat`
    /// says (field 41, `policy`; the reset-on-fork flag is not part of it).
    fn current_thread_is_realtime() -> bool {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("stat");
        // Fields after the command name (in parentheses, possibly with spaces) start at 3.
        let after = &stat[stat.rfind(')').expect("comm") + 1..];
        let policy: i32 = after
            .split_whitespace()
            .nth(41 - 3)
            .expect("policy")
            .parse()
            .expect("number");
        policy == libc::SCHED_FIFO
    }

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
                    // Unprivileged: refused, and the thread is as it was.
                    assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
                    assert!(!current_thread_is_realtime());
                }
            }
        })
        .join()
        .unwrap();
    }
}
