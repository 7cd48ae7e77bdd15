//! How to reach and attach a controller: [`ConnectOptions`] (address, NQNs, digests, timeouts, TLS,
//! DH-HMAC-CHAP, reconnects, ANA refresh) with its defaults, and [`Recovery`], what a lost connection does to
//! the commands outstanding on it.

use std::net::SocketAddr;
use std::time::Duration;

use crate::Error;

/// Largest transfer we issue in one command when the controller sets no limit (MDTS 0).
pub const DEFAULT_MAX_TRANSFER: u32 = 1024 * 1024;

/// The I/O queues a host asks a controller for unless told otherwise ([`ConnectOptions::io_queues`]).
pub const DEFAULT_IO_QUEUES: u16 = 1024;

/// How to reach and attach a controller.
///
/// # Examples
///
/// Defaults from [`ConnectOptions::new`], then the fields and setters for what differs:
///
/// ```
/// use std::time::Duration;
/// use nvpoll_tcp::host::{ConnectOptions, Recovery};
/// use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
///
/// let hostnqn = "nqn.2014-08.org.nvmexpress:uuid:123e4567-e89b-12d3-a456-426614174000";
/// let mut opts = ConnectOptions::new("192.0.2.7:4420".parse()?, "nqn.2024-01.io.example:sub", hostnqn);
/// assert_eq!(opts.kato, Duration::from_secs(10));
/// assert_eq!(opts.recovery, Recovery::Retry);
/// opts.header_digest = true;
/// opts.ctrl_loss_tmo = Duration::from_secs(10);
/// opts.recovery = Recovery::FailFast; // fail outstanding commands at once when the connection drops
///
/// // TLS with a configured PSK (a test key, not a secret):
/// let key = ConfiguredKey::parse("NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:")?;
/// let tls = opts.clone().with_tls_key(&key, IdentityVersion::V1);
/// assert!(tls.tls.is_some());
/// let verbatim = opts.clone().with_tls_identity(&key, "NVMe0R01 host subsystem");
/// assert!(verbatim.tls.is_some());
///
/// // DH-HMAC-CHAP, the host's secret only (a test secret):
/// let auth = opts.with_dhchap("DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:", None)?;
/// assert!(auth.dhchap.is_some());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Target address.
    pub addr: SocketAddr,
    /// Subsystem NQN.
    pub subnqn: String,
    /// Host NQN.
    pub hostnqn: String,
    /// Host identifier (16 bytes).
    pub hostid: [u8; 16],
    /// Ask for header digests.
    pub header_digest: bool,
    /// Ask for data digests.
    pub data_digest: bool,
    /// Keep Alive Timeout; zero disables keep-alive.
    pub kato: Duration,
    /// Time allowed for each bring-up step (connect, ICResp, each admin command).
    pub timeout: Duration,
    /// Admin queue depth.
    pub admin_depth: u16,
    /// I/O queues to ask for in Set Features (Number of Queues), 1 to 65535; the controller may grant fewer
    /// ([`TcpController::io_queues_allowed`](super::TcpController::io_queues_allowed)). Default
    /// [`DEFAULT_IO_QUEUES`] (as SPDK's host): enough for any controller we know of (SPDK's nvmf_tgt and Linux
    /// nvmet grant 127-128 by default, ours 128), and queues are connected only when asked for, so asking for
    /// many costs nothing.
    pub io_queues: u16,
    /// Largest transfer per command we are willing to issue (further limited by MDTS).
    pub max_transfer: u32,
    /// TLS 1.3 with an external PSK on every queue (admin and I/O), before ICReq; see
    /// [`ConnectOptions::with_tls_key`].
    pub tls: Option<crate::tls::ClientConfig>,
    /// With TLS: when each queue renews its keys (default: a KeyUpdate asking the target too after 2^23
    /// records under one key, or an hour). A target that ends the connection at our KeyUpdate (kernel TLS
    /// without re-keying) is noticed, said once in the log, and this controller's queues renew by
    /// reconnecting before the count instead.
    pub tls_key_renewal: crate::KeyRenewal,
    /// After a connection is lost, the time between reconnect attempts (nvme-cli's `--reconnect-delay`).
    pub reconnect_delay: Duration,
    /// How long to keep trying to reconnect before giving the controller up (nvme-cli's `--ctrl-loss-tmo`);
    /// then every outstanding and later command fails.
    pub ctrl_loss_tmo: Duration,
    /// A command outstanding this long is aborted (Abort on the admin queue); if it is still outstanding a
    /// second `io_timeout / 2` later, it fails with a timeout and its connection is reset.
    pub io_timeout: Duration,
    /// What a lost connection does to the commands that were outstanding on it.
    pub recovery: Recovery,
    /// With a controller that reports ANA: how often its ANA log is read again (also at once after a
    /// command failed with a path status). Zero: only then.
    pub ana_refresh: Duration,
    /// The TCP congestion control of every queue's connection (`setsockopt(TCP_CONGESTION)`, e.g. `cubic`;
    /// `system` keeps the system's). `None`: the system's, except that a connection to this machine under BBR
    /// gets cubic ([`crate::conn::loopback_congestion`]). The host sends the data of writes, so this paces
    /// them.
    pub tcp_congestion: Option<String>,
    /// In-band authentication (DH-HMAC-CHAP) of every queue, admin and I/O, when the controller asks for it
    /// in Connect's response; see [`ConnectOptions::with_dhchap`]. Without it, a controller that requires
    /// authentication is refused with [`Error::Auth`].
    pub dhchap: Option<crate::dhchap::host::HostAuth>,
    /// Keep SQ flow control on the I/O queues. `false` (the default): each I/O queue's Connect asks the
    /// controller to disable it (CATTR bit 2, as Linux's host does with `disable_sqflow`). The host never has
    /// more commands outstanding than the queue holds, so it needs no SQ head pointer, and a controller that
    /// agrees may complete a successful read with its last C2HData (the SUCCESS flag) instead of a C2HData and
    /// a response capsule: one PDU less to build, send, receive and parse per read (Linux nvmet and our
    /// target do; SPDK's nvmf_tgt sends SUCCESS either way). A controller that refuses the Connect for it
    /// (Invalid Field, or Connect Invalid Parameters naming CATTR) gets the queue connected again with flow
    /// control on, and the log says so.
    pub sq_flow_control: bool,
}

/// What happens to outstanding commands when their connection is lost.
///
/// In both cases a command completes exactly once, and a write completes successfully only when the target
/// acknowledged it on a live connection.
///
/// See [`ConnectOptions`]' example.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recovery {
    /// Keep them and submit them again on the new connection after the reconnect (as the Linux host does);
    /// commands submitted while reconnecting wait too. They fail only when `ctrl_loss_tmo` expires.
    #[default]
    Retry,
    /// Fail them at once with a transport error; commands submitted while reconnecting are refused.
    FailFast,
}

impl ConnectOptions {
    /// Options for a `trtype:tcp` transport ID, with the defaults of [`ConnectOptions::new`]. The host NQN is
    /// `hostnqn` if given, else the transport ID's `hostnqn:`, else this machine's (see
    /// [`nvpoll::trid::default_hostnqn`]); the host ID comes from the host NQN's UUID or `/etc/nvme/hostid`.
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::trid::{parse_uuid, TransportId};
    /// use nvpoll_tcp::host::ConnectOptions;
    ///
    /// let trid: TransportId = "trtype:tcp traddr:192.0.2.7 subnqn:nqn.2024-01.io.example:sub".parse()?;
    /// let hostnqn = "nqn.2014-08.org.nvmexpress:uuid:123e4567-e89b-12d3-a456-426614174000";
    /// let opts = ConnectOptions::from_trid(&trid, Some(hostnqn))?;
    /// assert_eq!(opts.addr.port(), 4420);
    /// assert_eq!(opts.subnqn, "nqn.2024-01.io.example:sub");
    /// assert_eq!(Some(opts.hostid), parse_uuid("123e4567-e89b-12d3-a456-426614174000"));
    ///
    /// let pcie: TransportId = "trtype:pcie traddr:0000:00:04.0".parse()?;
    /// assert!(ConnectOptions::from_trid(&pcie, Some(hostnqn)).is_err(), "not NVMe/TCP");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_trid(
        trid: &nvpoll::trid::TransportId,
        hostnqn: Option<&str>,
    ) -> Result<ConnectOptions, Error> {
        let nvpoll::trid::TransportId::Tcp {
            addr,
            subnqn,
            hostnqn: trid_hostnqn,
        } = trid
        else {
            return Err(Error::InvalidArgument(format!(
                "trtype:{} is not NVMe/TCP",
                trid.trtype()
            )));
        };
        let subnqn = subnqn
            .clone()
            .ok_or_else(|| Error::InvalidArgument("the transport ID needs subnqn:NQN".into()))?;
        let hostnqn = match hostnqn.map(str::to_string).or_else(|| trid_hostnqn.clone()) {
            Some(n) => n,
            None => nvpoll::trid::default_hostnqn()
                .map_err(|e| Error::io("reading the host NQN (give one)", e))?,
        };
        let mut o = ConnectOptions::new(*addr, subnqn, hostnqn);
        o.hostid = nvpoll::trid::hostid_from_hostnqn(&o.hostnqn)
            .or_else(|| nvpoll::trid::default_hostid().ok())
            .unwrap_or_default();
        Ok(o)
    }

    /// Options with defaults: no digests, KATO 10 s, 5 s per step, admin depth 32, 1024 I/O queues asked for
    /// (the controller grants what it has), 1 MiB transfers, reconnect
    /// every 2 s for up to 60 s, 30 s command timeout, outstanding commands retried after a reconnect, the ANA
    /// log read every second, the system's TCP congestion control, SQ flow control off on I/O queues. See [`ConnectOptions`]' example.
    pub fn new(addr: SocketAddr, subnqn: impl Into<String>, hostnqn: impl Into<String>) -> Self {
        ConnectOptions {
            addr,
            subnqn: subnqn.into(),
            hostnqn: hostnqn.into(),
            hostid: [0; 16],
            header_digest: false,
            data_digest: false,
            kato: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            admin_depth: 32,
            io_queues: DEFAULT_IO_QUEUES,
            max_transfer: DEFAULT_MAX_TRANSFER,
            tls: None,
            tls_key_renewal: crate::KeyRenewal::default(),
            reconnect_delay: Duration::from_secs(2),
            ctrl_loss_tmo: Duration::from_secs(60),
            io_timeout: Duration::from_secs(30),
            recovery: Recovery::Retry,
            ana_refresh: Duration::from_secs(1),
            tcp_congestion: None,
            dhchap: None,
            sq_flow_control: false,
        }
    }

    /// Authenticates with DH-HMAC-CHAP: the host's secret and, to authenticate the controller too, the
    /// controller's, both in the `DHHC-1:hh:<base64>:` form (nvme-cli's `--dhchap-secret` and
    /// `--dhchap-ctrl-secret`). Every hash and DH group is offered. See [`ConnectOptions`]' example; a
    /// secret not in that form is refused:
    ///
    /// ```
    /// use nvpoll_tcp::host::ConnectOptions;
    ///
    /// let opts = ConnectOptions::new("192.0.2.7:4420".parse()?, "nqn.2024-01.io.example:sub", "nqn.2024-01.io.example:host");
    /// assert!(opts.with_dhchap("secret", None).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_dhchap(mut self, secret: &str, ctrl_secret: Option<&str>) -> Result<Self, Error> {
        use crate::dhchap::Secret;
        let secret =
            Secret::parse(secret).map_err(|e| Error::InvalidArgument(format!("host key: {e}")))?;
        let ctrl = ctrl_secret
            .map(Secret::parse)
            .transpose()
            .map_err(|e| Error::InvalidArgument(format!("controller key: {e}")))?;
        self.dhchap = Some(crate::dhchap::host::HostAuth::new(secret, ctrl));
        Ok(self)
    }

    /// Turns on TLS from command-line style arguments: `key` in the interchange format, and either an identity
    /// given directly or the identity version (0 or 1) to derive.
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll_tcp::host::ConnectOptions;
    ///
    /// let opts = ConnectOptions::new("192.0.2.7:4420".parse()?, "nqn.2024-01.io.example:sub", "nqn.2024-01.io.example:host");
    /// let key = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"; // a test key
    /// let derived = opts.clone().with_psk_args(key, None, 1)?;
    /// assert!(derived.tls.is_some());
    /// assert!(opts.with_psk_args("NVMeTLSkey-1:01:short:", None, 1).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_psk_args(
        self,
        key: &str,
        identity: Option<&str>,
        version: u8,
    ) -> Result<Self, Error> {
        let key = crate::tls::ConfiguredKey::parse(key)
            .map_err(|e| Error::InvalidArgument(format!("PSK: {e}")))?;
        Ok(match identity {
            Some(id) => self.with_tls_identity(&key, id),
            None => self.with_tls_key(
                &key,
                if version == 0 {
                    crate::tls::IdentityVersion::V0
                } else {
                    crate::tls::IdentityVersion::V1
                },
            ),
        })
    }

    /// Turns on TLS with a configured PSK and an identity given directly (for instance one a target expects
    /// verbatim): the TLS PSK is derived from the key's retained PSK with that identity as context.
    /// See [`ConnectOptions`]' example.
    pub fn with_tls_identity(mut self, key: &crate::tls::ConfiguredKey, identity: &str) -> Self {
        let retained = key.retained(&self.hostnqn, crate::tls::Derivation::Rfc8446);
        self.tls = Some(crate::tls::ClientConfig::new(
            identity,
            retained.tls_psk(identity),
        ));
        self
    }

    /// Turns on TLS with a configured PSK (`NVMeTLSkey-1:...`): the identity and TLS PSK are derived for this
    /// host and subsystem (RFC 8446 derivation), and every queue uses the same identity.
    /// See [`ConnectOptions`]' example, and [`TcpController`](super::TcpController)'s (TLS against our target).
    pub fn with_tls_key(
        mut self,
        key: &crate::tls::ConfiguredKey,
        version: crate::tls::IdentityVersion,
    ) -> Self {
        let (identity, psk) = key.derive(
            version,
            &self.hostnqn,
            &self.subnqn,
            crate::tls::Derivation::Rfc8446,
        );
        self.tls = Some(crate::tls::ClientConfig::new(identity, psk));
        self
    }
}
