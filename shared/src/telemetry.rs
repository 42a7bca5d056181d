//! Tracing set-up and signal handling shared by every binary, so each `main` stays thin.

use tokio_util::sync::CancellationToken;

/// Logs to stderr, filtered by `RUST_LOG` (default `info`), coloured only on a terminal (log
/// files, `docker logs` and journald get plain text that tools can read). Safe to call twice.
pub fn init() {
    init_with_default("info");
}

/// Like [`init`], with another default filter when `RUST_LOG` is unset.
pub fn init_with_default(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Cancels `token` on SIGTERM or Ctrl-C; a second signal exits at once.
pub fn cancel_on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down (signal again to exit now)");
        token.cancel();
        wait_for_signal().await;
        std::process::exit(130);
    });
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
