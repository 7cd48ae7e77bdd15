// Our NVMe/TCP target for nvpoll-tcp's doctests only: they include it in hidden lines
// (`# mod target { include!("doctest/target.rs"); }`, `../doctest/target.rs` from host/) so that their
// examples connect to a live target. It is not a module of the crate and is not built with it; nvpoll-target
// is a dev-dependency.
//
// One subsystem, SUBNQN, with namespace 1 (8 MiB of RAM, 512-byte blocks), listening on a free port of
// 127.0.0.1, run by one reactor that sleeps when idle. The target stops when the `Running` is dropped.

use std::net::SocketAddr;

use nvpoll::reactor::{CoreList, IdlePolicy, Reactors};
use nvpoll_target::{Backing, SubsystemConfig, Target, TargetConfig, TargetHandle};

/// The subsystem's NQN.
pub const SUBNQN: &str = "nqn.2024-01.io.example:sub";
/// The host NQN the examples present.
pub const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:123e4567-e89b-12d3-a456-426614174000";

/// A running target.
pub struct Running {
    /// Where it listens (its first listener).
    pub addr: SocketAddr,
    /// Every listener's address, in configuration order.
    pub addrs: Vec<SocketAddr>,
    _handle: TargetHandle,
    _reactors: Reactors,
}

/// Starts the target with the default configuration.
pub fn start() -> Result<Running, Box<dyn std::error::Error>> {
    start_with(|c| c)
}

/// Starts the target with its configuration changed by `tweak` (TLS, say).
pub fn start_with(
    tweak: impl FnOnce(TargetConfig) -> TargetConfig,
) -> Result<Running, Box<dyn std::error::Error>> {
    let subsystem = SubsystemConfig::new(SUBNQN).namespace(Backing::Ram(8 << 20), 512);
    let config = tweak(TargetConfig::new("127.0.0.1:0".parse()?).subsystem(subsystem));
    let target = Target::bind(config)?;
    let addr = target.local_addr();
    let addrs = target.listeners().iter().map(|l| l.address).collect();
    let core = CoreList::all().cores()[0];
    let reactors = Reactors::builder()
        .idle(IdlePolicy::hybrid())
        .start(&CoreList::parse(&core.to_string())?)?;
    let handle = target.start(&reactors)?;
    Ok(Running { addr, addrs, _handle: handle, _reactors: reactors })
}
