//! What nvpoll's binaries share: `main`'s frame (the logger, the error line and the exit status), the
//! controller to attach to (`--trid` and the NVMe/TCP host options that follow it), and opening a controller
//! of either transport with the error messages the binaries print. Each binary uses the part it needs.

use nvpoll::api::Controller;
use nvpoll::mem::DmaPool;
use nvpoll::trid::{PciAddress, TransportId};
use nvpoll_pcie::{PcieController, PcieOptions};
use nvpoll_tcp::host::{ConnectOptions, TcpController};

/// Installs the binaries' logger at the `-v` count `verbose` ([`Verbosity`]), runs `body`, and on an error
/// prints `NAME: ERROR` on stderr and exits with status 1.
pub fn run_main(name: &str, verbose: u8, body: impl FnOnce() -> Result<(), String>) {
    crate::logging::init(verbose);
    if let Err(e) = body() {
        eprintln!("{name}: {e}");
        std::process::exit(1);
    }
}

// The binaries' -v flag (flattened last into their arguments). A plain comment, not a doc comment: clap would take
// a doc comment for the binary's about.
#[derive(clap::Args, Debug)]
#[allow(missing_docs)] // see the plain comment above
pub struct Verbosity {
    /// More log lines from the libraries: -v info, -vv debug, -vvv trace (RUST_LOG, in env_logger's
    /// syntax, overrides this).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
}

// The controller a binary attaches to (flattened first into its arguments): --trid, then the NVMe/TCP host
// options ([`HostArgs`]); a plain comment for the same reason.
#[derive(clap::Args, Debug)]
#[allow(missing_docs)] // see the plain comment above
pub struct Target {
    /// Transport ID, e.g. 'trtype:tcp traddr:127.0.0.1 trsvcid:4420 subnqn:NQN' or
    /// 'trtype:pcie traddr:0000:01:00.0' (a controller bound to vfio-pci: see `nvpoll-setup bind`).
    #[arg(long)]
    pub trid: String,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub host: HostArgs,
}

// The options of an NVMe/TCP host that connects to one controller (flattened into a binary's arguments, after
// its --trid, as in [`Target`]); a plain comment for the same reason.
#[derive(clap::Args, Debug)]
#[allow(missing_docs)] // see the plain comment above
pub struct HostArgs {
    /// Host NQN (default: /etc/nvme/hostnqn, or one derived from the machine's UUID).
    #[arg(long)]
    pub hostnqn: Option<String>,
    /// TLS 1.3 PSK in the NVMe interchange format (NVMeTLSkey-1:01:...:); TLS runs before ICReq on every queue.
    #[arg(long)]
    pub psk: Option<String>,
    /// With --psk: the TLS PSK identity to present verbatim (default: derived from the host and subsystem NQNs).
    #[arg(long, requires = "psk")]
    pub psk_identity: Option<String>,
    /// With --psk: the identity version to derive, 0 (NVMe0R0x) or 1 (NVMe1R0x with the digest).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub psk_identity_version: u8,
    /// DH-HMAC-CHAP host secret (DHHC-1:hh:...:, as nvme-cli's gen-dhchap-key writes it), or a file holding
    /// it: every queue authenticates in band when the controller asks.
    #[arg(long, short = 'S')]
    pub dhchap_secret: Option<String>,
    /// With --dhchap-secret: the controller's DH-HMAC-CHAP secret (or a file holding it), to authenticate
    /// the controller too (bidirectional).
    #[arg(long, short = 'C', requires = "dhchap_secret")]
    pub dhchap_ctrl_secret: Option<String>,
    /// With --dhchap-secret: the hashes to offer, comma-separated, preferred first (default
    /// sha512,sha384,sha256).
    #[arg(long, requires = "dhchap_secret")]
    pub dhchap_hashes: Option<String>,
    /// With --dhchap-secret: the DH groups to offer, comma-separated, preferred first (default
    /// ffdhe8192,...,ffdhe2048,null).
    #[arg(long, requires = "dhchap_secret")]
    pub dhchap_dhgroups: Option<String>,
    /// With --dhchap-secret: secure channel concatenation (as nvme-cli's --concat): the admin queue
    /// authenticates without TLS and generates a TLS PSK, and every queue then runs TLS 1.3 with it.
    #[arg(long, requires = "dhchap_secret")]
    pub concat: bool,
}

/// What a binary's argument or step failed on: the flag or step, and the library's error as the source.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct CliError {
    /// The flag (`--trid`) or the step (`DMA pool`, `connecting to ADDR`).
    pub what: String,
    /// Why.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl CliError {
    /// `what` failed with `source`.
    pub fn new(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> CliError {
        CliError {
            what: what.into(),
            source: source.into(),
        }
    }
}

/// The binaries report errors as text ([`run_main`] prints it).
impl From<CliError> for String {
    fn from(e: CliError) -> String {
        e.to_string()
    }
}

/// A DH-HMAC-CHAP secret given on the command line: the `DHHC-1:...` string itself, or a file that holds it.
pub fn dhchap_secret_arg(flag: &str, v: &str) -> Result<String, CliError> {
    if v.trim_start().starts_with("DHHC-1:") {
        return Ok(v.trim().to_string());
    }
    let text = std::fs::read_to_string(v).map_err(|e| {
        CliError::new(
            format!("{flag}: neither a DHHC-1:...: secret nor a readable file ({v})"),
            e,
        )
    })?;
    Ok(text.trim().to_string())
}

/// The DH-HMAC-CHAP options of a host.
#[derive(Clone, Copy, Debug, Default)]
pub struct DhchapArgs<'a> {
    /// --dhchap-secret
    pub secret: Option<&'a str>,
    /// --dhchap-ctrl-secret
    pub ctrl: Option<&'a str>,
    /// --dhchap-hashes
    pub hashes: Option<&'a str>,
    /// --dhchap-dhgroups
    pub groups: Option<&'a str>,
    /// --concat
    pub concat: bool,
}

/// Adds DH-HMAC-CHAP to `opts` from --dhchap-secret, --dhchap-ctrl-secret, --dhchap-hashes and
/// --dhchap-dhgroups.
pub fn with_dhchap(opts: ConnectOptions, a: DhchapArgs<'_>) -> Result<ConnectOptions, CliError> {
    use nvpoll_tcp::dhchap::{DhGroup, Hash};
    let Some(secret) = a.secret else {
        return Ok(opts);
    };
    let secret = dhchap_secret_arg("--dhchap-secret", secret)?;
    let ctrl = a
        .ctrl
        .map(|c| dhchap_secret_arg("--dhchap-ctrl-secret", c))
        .transpose()?;
    let mut opts = opts
        .with_dhchap(&secret, ctrl.as_deref())
        .map_err(|e| CliError::new("--dhchap-secret", e))?;
    let auth = opts.dhchap.as_mut().expect("set just now");
    auth.concat = a.concat;
    if let Some(list) = a.hashes {
        auth.hashes = list
            .split(',')
            .map(Hash::from_name)
            .collect::<Result<_, _>>()
            .map_err(|e| CliError::new("--dhchap-hashes", e))?;
    }
    if let Some(list) = a.groups {
        auth.groups = list
            .split(',')
            .map(DhGroup::from_name)
            .collect::<Result<_, _>>()
            .map_err(|e| CliError::new("--dhchap-dhgroups", e))?;
    }
    Ok(opts)
}

impl HostArgs {
    /// The connect options for the NVMe/TCP transport ID `trid`: its address and NQNs, the host NQN and, with
    /// --psk, the TLS key and identity.
    pub fn connect_options(&self, trid: &TransportId) -> Result<ConnectOptions, CliError> {
        let opts = ConnectOptions::from_trid(trid, self.hostnqn.as_deref())
            .map_err(|e| CliError::new("--trid", e))?;
        let opts = with_dhchap(
            opts,
            DhchapArgs {
                secret: self.dhchap_secret.as_deref(),
                ctrl: self.dhchap_ctrl_secret.as_deref(),
                hashes: self.dhchap_hashes.as_deref(),
                groups: self.dhchap_dhgroups.as_deref(),
                concat: self.concat,
            },
        )?;
        match &self.psk {
            Some(k) => opts
                .with_psk_args(k, self.psk_identity.as_deref(), self.psk_identity_version)
                .map_err(|e| CliError::new("--psk", e)),
            None => Ok(opts),
        }
    }
}

/// Parses `--trid`'s value.
pub fn parse_trid(trid: &str) -> Result<TransportId, CliError> {
    trid.parse().map_err(|e| CliError::new("--trid", e))
}

/// A DMA pool of `count` 4 KiB buffers.
pub fn dma_pool(count: usize) -> Result<DmaPool, CliError> {
    DmaPool::builder()
        .class(4096, count)
        .build()
        .map_err(|e| CliError::new("DMA pool", e))
}

/// Opens the PCIe controller at `bdf` (bound to vfio-pci) with `opts`, its DMA memory from `pool`.
pub fn open_pcie(
    bdf: PciAddress,
    pool: &DmaPool,
    opts: PcieOptions,
) -> Result<PcieController, CliError> {
    PcieController::open(bdf, pool.clone(), opts)
        .map_err(|e| CliError::new(format!("opening {bdf}"), e))
}

/// Connects to the NVMe/TCP controller `opts` names, its DMA memory from `pool`.
pub fn connect_tcp(opts: ConnectOptions, pool: &DmaPool) -> Result<TcpController, CliError> {
    let addr = opts.addr;
    TcpController::connect(opts, pool.clone())
        .map_err(|e| CliError::new(format!("connecting to {addr}"), e))
}

/// Shuts `ctrl` down.
pub fn shutdown<C: Controller>(ctrl: C) -> Result<(), CliError> {
    ctrl.shutdown().map_err(|e| CliError::new("shutdown", e))
}

/// `--tls-key-update RECORDS` (perf and the target): a record count a TLS key renewal takes (1 to 2^23).
pub fn parse_key_update(s: &str) -> Result<u64, CliError> {
    let n: u64 = s
        .parse()
        .map_err(|e| CliError::new("a number of records", e))?;
    nvpoll_tcp::KeyRenewal::after(n)
        .check()
        .map(|()| n)
        .map_err(|why| CliError::new("records", why))
}
