//! The engine's error: what is wrong with a job's file names or options, or what failed while attaching its
//! controllers and setting up its queue pairs and buffers. fio prints it (`ffi`) as one line, `nvpoll: ...`;
//! each message names the option or file at fault and, where it helps, what was expected.

use std::net::SocketAddr;

use nvpoll::trid::{PciAddress, TridError};
use nvpoll_tcp::tls::KeyError;

/// How a filename in fio's job should look, for the messages about one that does not.
pub(crate) const FILENAME_HINT: &str =
    "expected e.g. 'trtype=tcp adrfam=IPv4 traddr=127.0.0.1 trsvcid=4420 subnqn=NQN ns=1' \
     or 'trtype=PCIe traddr=0000.04.00.0 ns=1' (fio splits filenames at ':': write an NQN's \
     colons as '\\:' and a PCI address with dots)";

/// Everything the engine refuses or fails at.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The engine was built against another fio than the one it runs in.
    #[error(
        "this engine was built against {built}'s headers (ioengine ops version {ops_version}) and \
         cannot run in {running}: rebuild it against {running}'s source (scripts/fio-source.sh, or \
         FIO_DIR=/path/to/{running}'s source)"
    )]
    FioVersion {
        /// The fio whose headers the engine was built with (`fio-3.33`).
        built: String,
        /// Its ioengine interface version.
        ops_version: u32,
        /// The fio the engine runs in.
        running: String,
    },
    /// fio's thread structure is not laid out as the headers the engine was built with say.
    #[error(
        "fio's thread structure does not match the headers this engine was built with ({built}); \
         rebuild it against the running fio's source"
    )]
    FioHeaders {
        /// The fio whose headers the engine was built with.
        built: &'static str,
    },
    /// The job runs as processes (`thread=0`).
    #[error(
        "this engine needs thread=1 (fio jobs as threads of one process share its controllers)"
    )]
    NotThreads,
    /// The job has `directory=`.
    #[error("directory= means nothing here: a filename names a controller and namespace")]
    Directory,
    /// The job has `filesize=`.
    #[error("filesize= means nothing here: a namespace's size is its own (use size= and offset=)")]
    FileSize,
    /// Some of the job's files are unnamed (`nrfiles=` beyond the `filename=` list).
    #[error(
        "every file must be named: filename='trtype=tcp traddr=... trsvcid=... subnqn=NQN ns=N' \
         (nrfiles= cannot create controllers)"
    )]
    UnnamedFiles,
    /// `iodepth` does not fit a queue pair.
    #[error("iodepth={0} is out of range (1 to 65535)")]
    IoDepth(u64),

    /// A filename gives `ns` twice.
    #[error("filename '{name}': ns is given twice")]
    NsTwice {
        /// The filename.
        name: String,
    },
    /// A filename's `ns` is not a namespace ID.
    #[error("filename '{name}': ns={value} is not a namespace ID (1 to 4294967294)")]
    BadNsid {
        /// The filename.
        name: String,
        /// What `ns` was.
        value: String,
    },
    /// A filename has no transport ID keys.
    #[error("filename '{name}' names no controller: {FILENAME_HINT}")]
    NoController {
        /// The filename.
        name: String,
    },
    /// A filename's keys are not a transport ID.
    #[error("filename '{name}': {source}; {FILENAME_HINT}")]
    BadTransportId {
        /// The filename.
        name: String,
        /// What is wrong with the transport ID.
        #[source]
        source: TridError,
    },
    /// An NVMe/TCP filename has no `subnqn`.
    #[error("filename '{name}': subnqn is missing; {FILENAME_HINT}")]
    NoSubnqn {
        /// The filename.
        name: String,
    },
    /// A filename's `subnqn` is not an NQN: most likely fio cut it at an unescaped colon.
    #[error(
        "filename '{name}': subnqn '{nqn}' is not an NQN (nqn.yyyy-mm.reverse.domain:name). fio \
         splits filenames at every ':' that is not escaped, so write an NQN's colons as '\\:' \
         (subnqn={nqn}\\:name); fio removes the backslash"
    )]
    NotAnNqn {
        /// The filename.
        name: String,
        /// What `subnqn` was.
        nqn: String,
    },

    /// An option has a value it does not take.
    #[error("{option}={value}: expected {expected}")]
    BadOption {
        /// The option.
        option: &'static str,
        /// Its value.
        value: String,
        /// What it takes.
        expected: &'static str,
    },
    /// `send_mode` is not a send mode.
    #[error("send_mode: {0}")]
    SendMode(#[source] nvpoll::Error),
    /// `psk_path` cannot be read.
    #[error("psk_path: cannot read {path}: {source}")]
    PskRead {
        /// The path.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file at `psk_path` does not hold a PSK in the interchange format.
    #[error("psk_path: {path}: {source}")]
    PskKey {
        /// The path.
        path: String,
        /// What is wrong with the key.
        #[source]
        source: KeyError,
    },
    /// The PSK at `psk_path` could not be set up for the connection.
    #[error("psk_path: {path}: {source}")]
    PskSetup {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: nvpoll_tcp::Error,
    },
    /// A DH-HMAC-CHAP secret option is neither a secret nor a readable file.
    #[error("{option}: neither a DHHC-1:...: secret nor a readable file ({value}: {source})")]
    Secret {
        /// `dhchap_secret` or `dhchap_ctrl_secret`.
        option: &'static str,
        /// The option's value (a path, since it is no secret).
        value: String,
        /// Why the file could not be read.
        #[source]
        source: std::io::Error,
    },
    /// `dhchap_ctrl_secret` without `dhchap_secret`.
    #[error("dhchap_ctrl_secret needs dhchap_secret")]
    CtrlSecretAlone,
    /// The DH-HMAC-CHAP secrets could not be set up for the connection.
    #[error("dhchap_secret: {0}")]
    Dhchap(#[source] nvpoll_tcp::Error),
    /// An entry of `paths` is not an address and port.
    #[error("paths: '{0}' is not ADDR:PORT (an IP address and a port)")]
    BadPath(String),
    /// `paths` lists the filename's own address.
    #[error("paths: {0} is the filename's own address; list only the others")]
    OwnPath(SocketAddr),
    /// The connection options of an NVMe/TCP transport ID could not be made.
    #[error(transparent)]
    ConnectOptions(nvpoll_tcp::Error),

    /// The admin queue's DMA memory could not be had.
    #[error("{name}: DMA memory for the admin queue: {source}")]
    AdminMemory {
        /// The controller.
        name: String,
        /// Why.
        #[source]
        source: nvpoll::Error,
    },
    /// A PCIe controller could not be opened.
    #[error("opening {bdf}: {source}")]
    OpenPcie {
        /// The controller's address.
        bdf: PciAddress,
        /// Why.
        #[source]
        source: nvpoll_pcie::Error,
    },
    /// An NVMe/TCP controller could not be connected.
    #[error("connecting to {name}{}: {source}", if *multipath { " (multipath)" } else { "" })]
    Connect {
        /// The controller.
        name: String,
        /// Whether over several paths.
        multipath: bool,
        /// Why.
        #[source]
        source: nvpoll_tcp::Error,
    },
    /// The controller was shut down.
    #[error("the controller is shut down")]
    ShutDown,
    /// A job's I/O queue pair could not be created.
    #[error("{name}: creating an I/O queue pair: {source}")]
    CreateQueuePair {
        /// The controller.
        name: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// A queue pair refused the send mode.
    #[error("{name}: send_mode: {source}")]
    SetSendMode {
        /// The controller.
        name: String,
        /// Why.
        #[source]
        source: nvpoll::Error,
    },
    /// A namespace the filename names is not active.
    #[error("{name}: namespace {nsid} is not active (active: {active:?})")]
    InactiveNamespace {
        /// The controller.
        name: String,
        /// The namespace asked for.
        nsid: u32,
        /// The active ones.
        active: Vec<u32>,
    },
    /// The controller has no active namespace.
    #[error("{0}: the controller has no active namespace")]
    NoNamespace(String),
    /// The queue pair holds fewer commands than `iodepth`.
    #[error("{name}: the queue pair holds {holds} commands, fewer than iodepth={depth}")]
    QueueTooShallow {
        /// The controller.
        name: String,
        /// What the queue pair holds.
        holds: usize,
        /// `iodepth`.
        depth: u16,
    },
    /// A block size is not a multiple of the namespace's.
    #[error("{file}: a block size of {bs} bytes is not a multiple of the namespace's {block_size}-byte blocks")]
    BlockSize {
        /// The file (controller and namespace).
        file: String,
        /// The block size asked for.
        bs: u64,
        /// The namespace's.
        block_size: u32,
    },
    /// The largest block size exceeds the controller's largest transfer.
    #[error("{file}: bs={bs} exceeds the controller's largest transfer, {max} bytes")]
    TransferTooLarge {
        /// The file (controller and namespace).
        file: String,
        /// The largest block size.
        bs: u64,
        /// The controller's largest transfer.
        max: u32,
    },
    /// The job's I/O buffers could not be had.
    #[error("I/O buffers ({count} x {size} bytes): {source}")]
    IoBuffers {
        /// How many buffers.
        count: usize,
        /// Of what size.
        size: usize,
        /// Why.
        #[source]
        source: nvpoll::Error,
    },
    /// The job's I/O buffers could not be mapped for a PCIe controller's device.
    #[error("{name}: mapping the job's I/O buffers: {source}")]
    MapBuffers {
        /// The controller.
        name: String,
        /// Why.
        #[source]
        source: nvpoll_pcie::Error,
    },
    /// fio carved the I/O buffer area twice.
    #[error("the I/O buffers were carved twice")]
    CarvedTwice,
    /// An io_u's buffer overlaps another's or lies before the area.
    #[error(
        "io_u {index}'s buffer at {addr:#x} overlaps another or lies before the area at {base:#x}"
    )]
    BufferOverlaps {
        /// The io_u.
        index: usize,
        /// Its buffer's address.
        addr: usize,
        /// The area's.
        base: usize,
    },
    /// An io_u's buffer lies outside the area.
    #[error("io_u {index}'s buffer is outside the area: {source}")]
    BufferOutside {
        /// The io_u.
        index: usize,
        /// Why.
        #[source]
        source: nvpoll::Error,
    },
}

/// Why a transport failed, as the transport reports it, where the engine drives either kind of controller.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// NVMe/TCP (one path or several).
    #[error(transparent)]
    Tcp(#[from] nvpoll_tcp::Error),
    /// A transport seen through nvpoll's controller API (PCIe).
    #[error(transparent)]
    Api(#[from] nvpoll::Error),
}
