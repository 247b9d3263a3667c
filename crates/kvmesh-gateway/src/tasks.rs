//! The background tasks of a router (probe loops, DNS loops, KV-event readers and appliers,
//! the sweeper): spawned into one `JoinSet`, stopped by one cancellation token, joined on
//! shutdown — no flag polled around sleeps.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// A router's background tasks.
#[derive(Default)]
pub struct Tasks {
    token: CancellationToken,
    set: Mutex<JoinSet<()>>,
}

impl Tasks {
    /// Runs `fut` until it ends or the router stops (call from within the runtime).
    pub fn spawn(&self, fut: impl Future<Output = ()> + Send + 'static) {
        let token = self.token.clone();
        let mut set = self.set.lock().unwrap_or_else(|p| p.into_inner());
        // Reap the finished ones so the set does not grow with engines come and gone.
        while set.try_join_next().is_some() {}
        set.spawn(async move {
            tokio::select! {
                _ = token.cancelled() => {}
                _ = fut => {}
            }
        });
    }

    /// The router is stopping.
    pub fn is_stopping(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves when the router stops.
    pub async fn stopped(&self) {
        self.token.cancelled().await
    }

    /// Stops every task and waits for them (at most `within`; stragglers are aborted).
    pub async fn shutdown(&self, within: Duration) {
        self.token.cancel();
        let mut set = std::mem::take(&mut *self.set.lock().unwrap_or_else(|p| p.into_inner()));
        let _ =
            tokio::time::timeout(within, async { while set.join_next().await.is_some() {} }).await;
        set.abort_all();
    }

    /// Signals the stop without waiting (from `Drop`).
    pub fn cancel(&self) {
        self.token.cancel();
    }

    /// Tasks still running.
    pub fn len(&self) -> usize {
        self.set.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no task is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn shutdown_stops_and_joins_every_task() {
        let t = Tasks::default();
        for _ in 0..3 {
            t.spawn(async {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            });
        }
        t.spawn(async {});
        tokio::task::yield_now().await;
        assert!(!t.is_stopping());
        t.shutdown(Duration::from_secs(5)).await;
        assert!(t.is_stopping());
        assert!(t.is_empty());
    }
}
