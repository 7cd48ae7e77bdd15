//! Where the libraries' log lines go in nvpoll's binaries: stderr, as `crate: level: message` (for instance
//! `nvpoll: warning: no free hugepages ...`). The libraries only use the `log` facade; an embedder chooses its
//! own logger.

use std::io::Write as _;

/// Installs the binaries' logger on stderr. `RUST_LOG` (env_logger's syntax, e.g. `nvpoll_pcie=debug`) wins
/// when set; otherwise `verbosity` chooses the level: 0 warnings and errors, 1 (`-v`) info, 2 debug, 3 trace.
/// A second call changes nothing.
pub fn init(verbosity: u8) {
    let level = match verbosity {
        0 => log::LevelFilter::Warn,
        1 => log::LevelFilter::Info,
        2 => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    };
    let mut builder = env_logger::Builder::new();
    builder.filter_level(level);
    if let Ok(spec) = std::env::var("RUST_LOG") {
        builder.parse_filters(&spec);
    }
    builder.format(|buf, record| {
        let krate = record.target().split("::").next().unwrap_or("nvpoll");
        writeln!(
            buf,
            "{}: {}: {}",
            krate.replace('_', "-"),
            level_word(record.level()),
            record.args()
        )
    });
    // Another logger already installed (a test harness, an embedder): keep it.
    let _already = builder.try_init().is_err();
}

fn level_word(level: log::Level) -> &'static str {
    match level {
        log::Level::Error => "error",
        log::Level::Warn => "warning",
        log::Level::Info => "info",
        log::Level::Debug => "debug",
        log::Level::Trace => "trace",
    }
}
