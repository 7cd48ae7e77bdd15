//! The target's control socket: JSON-RPC 2.0 over a Unix stream socket, as SPDK's `rpc.py` speaks it.
//!
//! [`serve`] starts one thread (not a reactor) that accepts clients, and one more per connected client; each
//! request calls a [`TargetHandle`] method. Requests are JSON values on the stream, one after the other, with
//! or without newlines between them; a value may be a batch (an array of requests). Each answer is one JSON
//! value followed by a newline; a notification (a request without `id`) gets none.
//!
//! | method | params | result |
//! | --- | --- | --- |
//! | `listener_list` | | `[{address, tls}]` |
//! | `listener_add` | `{address, tls?}` | `{address}` (the real port if the request said 0) |
//! | `listener_remove` | `{address}` | `true` |
//! | `subsystem_list` | | `[{nqn, serial, model, allow_any_host, hosts, hosts_with_keys, namespaces: [{nsid, block_size, blocks, backing, ana_group}], listeners, max_io_queues, queue_size, mdts, controllers, ana: [{listener, group, state}]}]` |
//! | `subsystem_add` | a subsystem object, as in the configuration file ([`crate::config`]) | `true` |
//! | `subsystem_remove` | `{nqn}` | `true` |
//! | `namespace_add` | `{nqn, nsid?, ram \| file \| pcie, block_size?, ana_group?}` | `{nsid}` |
//! | `namespace_remove` | `{nqn, nsid}` | `true` |
//! | `host_add` | `{nqn, host, psk_file?}`: allows the host and sets its key; refused on a subsystem open to any host (turn that off first; `key_set` gives such a subsystem's host a key) | `true` |
//! | `host_remove` | `{nqn, host}`: disallows the host and drops its key | `true` |
//! | `subsystem_allow_any_host` | `{nqn, allow}` (`false`: only the hosts added since) | `true` |
//! | `subsystem_set_max_io_queues` | `{nqn, max_io_queues}` (1 to 1024; live controllers are torn down and their hosts reconnect with it) | `{controllers_torn_down}` |
//! | `key_set` | `{nqn, host, psk_file}` | `true` |
//! | `key_remove` | `{nqn, host}` | `true` |
//! | `dhchap_key_set` | `{nqn, host, key, ctrl_key?}`: the host's DH-HMAC-CHAP secret (`DHHC-1:...`) and optionally the controller's; the host's next authentication uses them | `true` |
//! | `dhchap_key_remove` | `{nqn, host}` | `true` |
//! | `subsystem_set_dhchap` | `{nqn, hashes?, dhgroups?}`: the hashes (`sha256` ...) and DH groups (`null`, `ffdhe2048` ...) allowed; absent or empty: all | `true` |
//! | `ana_state_set` | `{nqn, listener, group?, state}`: the state (`optimized`, `non-optimized`, `inaccessible`, `persistent-loss`, `change`) of ANA group `group` (default 1) for hosts on `listener`; they get an ANA change event | `{before, state}` |
//! | `tls_key_update_set` | `{records}`: TLS connections accepted from now on renew their keys after `records` records under one key (1 to 8388608) | `true` |
//! | `stats_get` | | the [`crate::TargetCounters`] fields |
//! | `rpc_get_methods` | | the method names |
//!
//! Errors: -32700 the stream is not JSON (the connection is then closed: nothing after it can be framed),
//! -32600 not a request, -32601 no such method, -32602 bad params (saying which field and why), -32000 the
//! target refused (its reason). A request that fails changes nothing. Keys never appear in an answer or a
//! log line: `subsystem_list` tells only which hosts have one, and key files are named, never quoted.
//!
//! The socket file is created with mode 0600, so only its owner (and root) may control the target. A socket
//! that a live server answers on is never taken over; one left by a server that died is replaced.
//! Relative paths in params are taken from the target's current folder.
//!
//! # Example
//! ```no_run
//! # fn demo(handle: nvpoll_target::TargetHandle) -> Result<(), nvpoll_target::Error> {
//! use std::path::Path;
//! use nvpoll_target::rpc::{self, serde_json::json, RpcClient, ServeOptions};
//!
//! let server = rpc::serve(Path::new("/tmp/nvpoll.sock"), handle, ServeOptions::default())?;
//! let mut client = RpcClient::connect(server.path())?;
//! let added = client.call("namespace_add", Some(json!({"nqn": "nqn.2024-01.io.nvpoll:a", "ram": "64M"})))?;
//! println!("{added:?}");
//! server.stop();
//! # Ok(()) }
//! ```

use std::fmt;
use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value};

pub use serde_json;

use crate::config::{self, Address, Parsed, PcieResolver};
use crate::error::Error;
pub use crate::error::RpcError;
use crate::options::{ListenerConfig, TlsMode};
use crate::server::{SubsystemInfo, TargetHandle};
use crate::subsystem::{HostAccess, HostKey};

/// JSON-RPC: the stream is not valid JSON.
pub const PARSE_ERROR: i64 = -32700;
/// JSON-RPC: the value is not a valid request.
pub const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC: no such method.
pub const METHOD_NOT_FOUND: i64 = -32601;
/// JSON-RPC: the params are wrong (the message says which field and how).
pub const INVALID_PARAMS: i64 = -32602;
/// The target refused a well-formed request (the message is its reason).
pub const TARGET_REFUSED: i64 = -32000;

/// The methods [`serve`] answers.
pub const METHODS: &[&str] = &[
    "listener_list",
    "listener_add",
    "listener_remove",
    "subsystem_list",
    "subsystem_add",
    "subsystem_remove",
    "namespace_add",
    "namespace_remove",
    "host_add",
    "host_remove",
    "subsystem_allow_any_host",
    "subsystem_set_max_io_queues",
    "key_set",
    "key_remove",
    "dhchap_key_set",
    "dhchap_key_remove",
    "subsystem_set_dhchap",
    "ana_state_set",
    "tls_key_update_set",
    "stats_get",
    "rpc_get_methods",
];

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    fn params(message: impl Into<String>) -> RpcError {
        RpcError::new(INVALID_PARAMS, message)
    }

    fn refused(e: Error) -> RpcError {
        RpcError::new(TARGET_REFUSED, e.to_string())
    }
}

/// Called with one line per request that changed the target (the method and what it named: subsystem,
/// host, namespace ID or address; never a key).
pub type ChangeHook = Arc<dyn Fn(&str) + Send + Sync>;

/// What [`serve`] needs besides the target.
#[derive(Clone)]
pub struct ServeOptions {
    /// Opens `pcie` namespaces (default: [`config::no_pcie`], which refuses them).
    pub pcie: Arc<PcieResolver<'static>>,
    /// Hears about every change made over the socket.
    pub on_change: Option<ChangeHook>,
}

impl Default for ServeOptions {
    fn default() -> ServeOptions {
        ServeOptions {
            pcie: Arc::new(config::no_pcie),
            on_change: None,
        }
    }
}

impl fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServeOptions").finish_non_exhaustive()
    }
}

/// How often a client's thread looks at the stop flag while it waits for a request.
const CLIENT_POLL: Duration = Duration::from_millis(100);
/// How long an answer may wait for a client that does not read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest request (a batch counts as one).
const MAX_REQUEST: usize = 1 << 20;
/// Clients served at once; more are closed at once.
const MAX_CLIENTS: usize = 32;

struct Shared {
    handle: TargetHandle,
    options: ServeOptions,
    stop: AtomicBool,
    /// One request at a time changes the target, so that a request that fails halfway can be undone.
    serial: Mutex<()>,
}

/// A running control socket. [`RpcServer::stop`], or dropping it, ends its threads and removes the socket
/// file.
pub struct RpcServer {
    path: PathBuf,
    /// The socket file's device and inode: it is removed at stop only if it is still this one.
    file_id: (u64, u64),
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for RpcServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RpcServer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Serves `handle`'s target on a Unix socket at `path` (created with mode 0600). Refused if a server already
/// answers there; a socket file nobody answers on is replaced; anything else at `path` is left alone (error).
pub fn serve(path: &Path, handle: TargetHandle, options: ServeOptions) -> Result<RpcServer, Error> {
    let (listener, file_id) = bind_private(path)?;
    let shared = Arc::new(Shared {
        handle,
        options,
        stop: AtomicBool::new(false),
        serial: Mutex::new(()),
    });
    let accepting = Arc::clone(&shared);
    let thread = std::thread::Builder::new()
        .name("nvpoll-rpc".into())
        .spawn(move || accept_loop(&listener, &accepting))
        .map_err(|e| Error::io("start the control socket's thread", e))?;
    Ok(RpcServer {
        path: path.to_path_buf(),
        file_id,
        shared,
        thread: Some(thread),
    })
}

impl RpcServer {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops serving: the threads end (a request being answered is finished first) and the socket file is
    /// removed.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::Release);
        // The accepting thread waits in accept(): a connection wakes it. If the file is gone, the thread ends
        // at its next client and is left to do so.
        if UnixStream::connect(&self.path).is_ok() {
            let _ = thread.join();
        }
        if let Ok(m) = fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.file_id {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Names for the temporary folders sockets are made in.
static NEXT_DIR: AtomicU64 = AtomicU64::new(0);

/// Binds a listening socket at `path` that only its owner can connect to, from the first moment: it is
/// made in a private folder, given mode 0600, then moved into place.
fn bind_private(path: &Path) -> Result<(UnixListener, (u64, u64)), Error> {
    let shown = path.display();
    match fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => {
            return Err(Error::NotASocket {
                path: path.to_path_buf(),
            })
        }
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => {
                return Err(Error::SocketInUse {
                    path: path.to_path_buf(),
                })
            }
            // Left by a server that is gone.
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                fs::remove_file(path)
                    .map_err(|e| Error::io(format!("remove the stale socket {shown}"), e))?;
            }
            Err(e) => return Err(Error::io(format!("probe {shown}"), e)),
        },
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("look at {shown}"), e)),
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = parent.join(format!(
        ".nvpoll-rpc.{}.{}",
        std::process::id(),
        NEXT_DIR.fetch_add(1, Ordering::Relaxed)
    ));
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let tmp = dir.join("s");
    let bound = UnixListener::bind(&tmp)
        .map_err(|e| Error::io(format!("bind a socket for {shown}"), e))
        .and_then(|l| {
            fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))
                .map_err(|e| Error::io(format!("chmod 600 {shown}"), e))?;
            fs::rename(&tmp, path).map_err(|e| Error::io(format!("create {shown}"), e))?;
            Ok(l)
        });
    let _ = fs::remove_file(&tmp);
    let _ = fs::remove_dir(&dir);
    let listener = bound?;
    let m = fs::symlink_metadata(path).map_err(|e| Error::io(format!("look at {shown}"), e))?;
    Ok((listener, (m.dev(), m.ino())))
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    let mut clients: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let accepted = listener.accept();
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        clients.retain(|c| !c.is_finished());
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => {
                // Out of file descriptors and the like: wait a little instead of spinning.
                std::thread::sleep(CLIENT_POLL);
                continue;
            }
        };
        if clients.len() >= MAX_CLIENTS {
            continue;
        }
        let shared = Arc::clone(shared);
        if let Ok(t) = std::thread::Builder::new()
            .name("nvpoll-rpc-client".into())
            .spawn(move || serve_client(&shared, stream))
        {
            clients.push(t);
        }
    }
    for c in clients {
        let _ = c.join();
    }
}

fn send(stream: &mut UnixStream, answer: &Value) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(answer).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    stream.write_all(&bytes)
}

fn error_answer(id: Value, e: &RpcError) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": e.code, "message": e.message}})
}

/// Answers the requests of one client until it closes, sends what is not JSON, or the server stops.
fn serve_client(shared: &Shared, mut stream: UnixStream) {
    if stream.set_read_timeout(Some(CLIENT_POLL)).is_err()
        || stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err()
    {
        return;
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let mut consumed = 0;
        let mut values = serde_json::Deserializer::from_slice(&buf).into_iter::<Value>();
        loop {
            match values.next() {
                Some(Ok(v)) => {
                    consumed = values.byte_offset();
                    if let Some(answer) = shared.answer(v) {
                        if send(&mut stream, &answer).is_err() {
                            return;
                        }
                    }
                }
                // The rest of a value is still to come.
                Some(Err(e)) if e.is_eof() => break,
                Some(Err(e)) => {
                    let e = RpcError::new(PARSE_ERROR, format!("parse error: {e}"));
                    let _ = send(&mut stream, &error_answer(Value::Null, &e));
                    return;
                }
                None => {
                    consumed = buf.len();
                    break;
                }
            }
        }
        buf.drain(..consumed);
        if buf.len() > MAX_REQUEST {
            let e = RpcError::new(
                PARSE_ERROR,
                format!("parse error: a request larger than {MAX_REQUEST} bytes"),
            );
            let _ = send(&mut stream, &error_answer(Value::Null, &e));
            return;
        }
        match stream.read(&mut chunk) {
            Ok(0) => {
                if !buf.iter().all(u8::is_ascii_whitespace) {
                    let e =
                        RpcError::new(PARSE_ERROR, "parse error: the stream ended in a request");
                    let _ = send(&mut stream, &error_answer(Value::Null, &e));
                }
                return;
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if shared.stop.load(Ordering::Acquire) {
                    return;
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// The params of a method, as a typed struct: any other field, a missing one or a wrong type is
/// [`INVALID_PARAMS`], naming the field.
fn params<T: DeserializeOwned>(params: &Value) -> Result<T, RpcError> {
    let object = match params {
        Value::Null => Value::Object(Map::new()),
        v @ Value::Object(_) => v.clone(),
        _ => return Err(RpcError::params("params must be an object")),
    };
    serde_path_to_error::deserialize(&object).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            RpcError::params(e.inner().to_string())
        } else {
            RpcError::params(format!("{path}: {}", e.inner()))
        }
    })
}

/// Params of the methods that take none.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParams {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListenerParams {
    address: Address,
    tls: Option<Parsed<TlsMode>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddressParams {
    address: Address,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NqnParams {
    nqn: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyUpdateParams {
    records: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AnaStateParams {
    nqn: String,
    listener: Address,
    #[serde(default = "first_ana_group")]
    group: u32,
    state: Parsed<nvpoll::spec::AnaState>,
}

fn first_ana_group() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NamespaceIdParams {
    nqn: String,
    nsid: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostParams {
    nqn: String,
    host: String,
    psk_file: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostNameParams {
    nqn: String,
    host: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyParams {
    nqn: String,
    host: String,
    psk_file: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DhchapKeyParams {
    nqn: String,
    host: String,
    key: String,
    ctrl_key: Option<String>,
    #[serde(default)]
    concat: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DhchapPolicyParams {
    nqn: String,
    #[serde(default)]
    hashes: Vec<String>,
    #[serde(default)]
    dhgroups: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AllowAnyParams {
    nqn: String,
    allow: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MaxIoQueuesParams {
    nqn: String,
    max_io_queues: u16,
}

/// A host's key from `psk_file`, its NQN checked first.
fn host_key(host: &str, psk_file: &Path) -> Result<HostKey, RpcError> {
    check_host(host)?;
    let key =
        config::read_key_file(psk_file).map_err(|m| RpcError::params(format!("psk_file: {m}")))?;
    Ok(HostKey {
        hostnqn: host.to_string(),
        key,
    })
}

fn check_host(host: &str) -> Result<(), RpcError> {
    config::check_nqn(host).map_err(|m| RpcError::params(format!("host: {m}")))
}

fn subsystem_json(s: &SubsystemInfo) -> Value {
    let (any, hosts) = match &s.hosts {
        HostAccess::AnyHost => (true, Vec::new()),
        HostAccess::Only(h) => (false, h.clone()),
    };
    let namespaces: Vec<Value> = s
        .namespaces
        .iter()
        .map(|n| {
            json!({"nsid": n.nsid, "block_size": n.block_size, "blocks": n.blocks, "backing": n.backing,
                   "ana_group": n.ana_group})
        })
        .collect();
    let listeners = s
        .listeners
        .as_ref()
        .map(|l| l.iter().map(ToString::to_string).collect::<Vec<_>>());
    json!({
        "nqn": s.nqn,
        "serial": s.serial,
        "model": s.model,
        "allow_any_host": any,
        "hosts": hosts,
        "hosts_with_keys": s.hosts_with_keys,
        "namespaces": namespaces,
        "listeners": listeners,
        "max_io_queues": s.max_io_queues,
        "queue_size": s.queue_entries,
        "mdts": s.mdts,
        "controllers": s.controllers,
        "ana": s.ana.iter().map(|a| json!({
            "listener": a.listener.to_string(), "group": a.group, "state": a.state.name()
        })).collect::<Vec<_>>(),
    })
}

impl Shared {
    /// The answer to one JSON value: a request, or a batch of them (`None`: only notifications).
    fn answer(&self, v: Value) -> Option<Value> {
        match v {
            Value::Array(items) if items.is_empty() => Some(error_answer(
                Value::Null,
                &RpcError::new(INVALID_REQUEST, "an empty batch"),
            )),
            Value::Array(items) => {
                let answers: Vec<Value> = items
                    .into_iter()
                    .filter_map(|item| self.request(item))
                    .collect();
                (!answers.is_empty()).then_some(Value::Array(answers))
            }
            other => self.request(other),
        }
    }

    /// The answer to one request (`None` for a notification).
    fn request(&self, v: Value) -> Option<Value> {
        let invalid = |id: Value, why: &str| {
            Some(error_answer(
                id,
                &RpcError::new(INVALID_REQUEST, format!("invalid request: {why}")),
            ))
        };
        let Value::Object(mut m) = v else {
            return invalid(Value::Null, "a request is an object");
        };
        let id = m.remove("id");
        let answer_id = match &id {
            None => Value::Null,
            Some(i @ (Value::Null | Value::String(_) | Value::Number(_))) => i.clone(),
            Some(_) => return invalid(Value::Null, "id must be a string, a number or null"),
        };
        if m.remove("jsonrpc") != Some(Value::String("2.0".into())) {
            return invalid(answer_id, "jsonrpc must be \"2.0\"");
        }
        let Some(Value::String(method)) = m.remove("method") else {
            return invalid(answer_id, "method must be a string");
        };
        let params = m.remove("params").unwrap_or(Value::Null);
        if let Some(other) = m.keys().next() {
            return invalid(answer_id, &format!("unknown member {other:?}"));
        }
        let result = if matches!(params, Value::Null | Value::Object(_)) {
            self.call(&method, params)
        } else {
            Err(RpcError::params("params must be an object"))
        };
        // A notification is answered with nothing, even when it failed.
        id.as_ref()?;
        Some(match result {
            Ok(r) => json!({"jsonrpc": "2.0", "id": answer_id, "result": r}),
            Err(e) => error_answer(answer_id, &e),
        })
    }

    fn changed(&self, line: String) {
        if let Some(f) = &self.options.on_change {
            f(&line);
        }
    }

    /// Reports the change `line` and answers `true`, as the methods that change something do.
    fn applied(&self, line: String) -> Result<Value, RpcError> {
        self.changed(line);
        Ok(Value::Bool(true))
    }

    fn call(&self, method: &str, p: Value) -> Result<Value, RpcError> {
        let _one_at_a_time = self.serial.lock().unwrap_or_else(|e| e.into_inner());
        let h = &self.handle;
        match method {
            "listener_list" => {
                params::<NoParams>(&p)?;
                let list: Vec<Value> = h
                    .listeners()
                    .iter()
                    .map(|l| json!({"address": l.address.to_string(), "tls": l.tls.as_str()}))
                    .collect();
                Ok(Value::Array(list))
            }
            "listener_add" => {
                let p: ListenerParams = params(&p)?;
                let tls = p.tls.map_or(TlsMode::Off, |t| t.0);
                let address = h
                    .add_listener(ListenerConfig {
                        address: p.address.0,
                        tls,
                    })
                    .map_err(RpcError::refused)?;
                self.changed(format!("listener_add {address} (TLS {tls})"));
                Ok(json!({"address": address.to_string()}))
            }
            "listener_remove" => {
                let p: AddressParams = params(&p)?;
                h.remove_listener(p.address.0).map_err(RpcError::refused)?;
                self.applied(format!("listener_remove {}", p.address.0))
            }
            "subsystem_list" => {
                params::<NoParams>(&p)?;
                Ok(Value::Array(
                    h.subsystems().iter().map(subsystem_json).collect(),
                ))
            }
            "subsystem_add" => {
                if !p.is_object() {
                    return Err(RpcError::params("params must be a subsystem object"));
                }
                let listeners: Vec<_> = h.listeners().iter().map(|l| l.address).collect();
                let cfg = config::parse_subsystem(&p, &listeners, &*self.options.pcie)
                    .map_err(|e| RpcError::params(e.to_string()))?;
                h.add_subsystem(&cfg).map_err(RpcError::refused)?;
                self.applied(format!("subsystem_add {}", cfg.nqn))
            }
            "subsystem_remove" => {
                let p: NqnParams = params(&p)?;
                h.remove_subsystem(&p.nqn).map_err(RpcError::refused)?;
                self.applied(format!("subsystem_remove {}", p.nqn))
            }
            "namespace_add" => {
                let Value::Object(mut object) = p else {
                    return Err(RpcError::params("params must be an object"));
                };
                let nqn = match object.remove("nqn") {
                    Some(Value::String(s)) => s,
                    Some(_) => return Err(RpcError::params("nqn: must be a string")),
                    None => return Err(RpcError::params("missing field `nqn`")),
                };
                let ns = config::parse_namespace(&Value::Object(object), &*self.options.pcie)
                    .map_err(|e| RpcError::params(e.to_string()))?;
                let nsid = h.add_namespace(&nqn, &ns).map_err(RpcError::refused)?;
                self.changed(format!("namespace_add {nqn} nsid {nsid}"));
                Ok(json!({"nsid": nsid}))
            }
            "namespace_remove" => {
                let p: NamespaceIdParams = params(&p)?;
                h.remove_namespace(&p.nqn, p.nsid)
                    .map_err(RpcError::refused)?;
                self.applied(format!("namespace_remove {} nsid {}", p.nqn, p.nsid))
            }
            "host_add" => {
                let p: HostParams = params(&p)?;
                check_host(&p.host)?;
                let key = match &p.psk_file {
                    Some(f) => Some(host_key(&p.host, f)?),
                    None => None,
                };
                h.allow_host(&p.nqn, &p.host).map_err(RpcError::refused)?;
                if let Some(key) = key {
                    if let Err(e) = h.set_host_key(&p.nqn, key) {
                        // Undo the half done.
                        let _ = h.disallow_host(&p.nqn, &p.host);
                        return Err(RpcError::refused(e));
                    }
                }
                let with = if p.psk_file.is_some() {
                    " with a key"
                } else {
                    ""
                };
                self.applied(format!("host_add {} host {}{with}", p.nqn, p.host))
            }
            "host_remove" => {
                let p: HostNameParams = params(&p)?;
                let info = self.info(&p.nqn)?;
                let allowed = matches!(&info.hosts, HostAccess::Only(l) if l.contains(&p.host));
                let keyed = info.hosts_with_keys.contains(&p.host);
                if !allowed && !keyed {
                    return Err(RpcError::new(
                        TARGET_REFUSED,
                        format!(
                            "host {} is neither allowed on {} nor has a key for it",
                            p.host, p.nqn
                        ),
                    ));
                }
                if allowed {
                    h.disallow_host(&p.nqn, &p.host)
                        .map_err(RpcError::refused)?;
                }
                if keyed {
                    h.remove_host_key(&p.nqn, &p.host)
                        .map_err(RpcError::refused)?;
                }
                self.applied(format!("host_remove {} host {}", p.nqn, p.host))
            }
            "subsystem_set_max_io_queues" => {
                let p: MaxIoQueuesParams = params(&p)?;
                let torn = h
                    .set_max_io_queues(&p.nqn, p.max_io_queues)
                    .map_err(RpcError::refused)?;
                self.changed(format!(
                    "subsystem_set_max_io_queues {} {} ({torn} controllers torn down to reconnect)",
                    p.nqn, p.max_io_queues
                ));
                Ok(json!({"controllers_torn_down": torn}))
            }
            "subsystem_allow_any_host" => {
                let p: AllowAnyParams = params(&p)?;
                h.set_allow_any_host(&p.nqn, p.allow)
                    .map_err(RpcError::refused)?;
                self.applied(format!("subsystem_allow_any_host {} {}", p.nqn, p.allow))
            }
            "key_set" => {
                let p: KeyParams = params(&p)?;
                let key = host_key(&p.host, &p.psk_file)?;
                h.set_host_key(&p.nqn, key).map_err(RpcError::refused)?;
                self.applied(format!("key_set {} host {}", p.nqn, p.host))
            }
            "key_remove" => {
                let p: HostNameParams = params(&p)?;
                h.remove_host_key(&p.nqn, &p.host)
                    .map_err(RpcError::refused)?;
                self.applied(format!("key_remove {} host {}", p.nqn, p.host))
            }
            "dhchap_key_set" => {
                let p: DhchapKeyParams = params(&p)?;
                check_host(&p.host)?;
                let secret = |field: &str, v: &str| {
                    nvpoll_wire::dhchap::Secret::parse(v)
                        .map_err(|e| RpcError::params(format!("{field}: {e}")))
                };
                let key = crate::DhchapKey {
                    hostnqn: p.host.clone(),
                    key: secret("key", &p.key)?,
                    ctrl_key: p
                        .ctrl_key
                        .as_deref()
                        .map(|c| secret("ctrl_key", c))
                        .transpose()?,
                    concat: p.concat,
                };
                h.set_dhchap_key(&p.nqn, key).map_err(RpcError::refused)?;
                self.applied(format!(
                    "dhchap_key_set {} host {}{}",
                    p.nqn,
                    p.host,
                    if p.ctrl_key.is_some() {
                        " (with a controller key)"
                    } else {
                        ""
                    }
                ))
            }
            "dhchap_key_remove" => {
                let p: HostNameParams = params(&p)?;
                h.remove_dhchap_key(&p.nqn, &p.host)
                    .map_err(RpcError::refused)?;
                self.applied(format!("dhchap_key_remove {} host {}", p.nqn, p.host))
            }
            "subsystem_set_dhchap" => {
                let p: DhchapPolicyParams = params(&p)?;
                let mut policy = crate::DhchapPolicy::default();
                for n in &p.hashes {
                    policy.hashes.push(
                        nvpoll_wire::dhchap::Hash::from_name(n)
                            .map_err(|e| RpcError::params(format!("hashes: {e}")))?,
                    );
                }
                for n in &p.dhgroups {
                    policy.groups.push(
                        nvpoll_wire::dhchap::DhGroup::from_name(n)
                            .map_err(|e| RpcError::params(format!("dhgroups: {e}")))?,
                    );
                }
                h.set_dhchap_policy(&p.nqn, policy)
                    .map_err(RpcError::refused)?;
                self.applied(format!(
                    "subsystem_set_dhchap {} hashes {:?} dhgroups {:?}",
                    p.nqn, p.hashes, p.dhgroups
                ))
            }
            "ana_state_set" => {
                let p: AnaStateParams = params(&p)?;
                let state = p.state.0;
                let before = h
                    .set_ana_state(&p.nqn, p.listener.0, p.group, state)
                    .map_err(RpcError::refused)?;
                self.changed(format!(
                    "ana_state_set {} listener {} group {}: {before} -> {state}",
                    p.nqn, p.listener.0, p.group
                ));
                Ok(json!({"before": before.name(), "state": state.name()}))
            }
            "tls_key_update_set" => {
                let p: KeyUpdateParams = params(&p)?;
                h.set_tls_key_update(p.records).map_err(RpcError::refused)?;
                self.changed(format!("tls_key_update_set {}", p.records));
                Ok(Value::Bool(true))
            }
            "stats_get" => {
                params::<NoParams>(&p)?;
                Ok(serde_json::to_value(h.counters()).expect("counters are plain integers"))
            }
            "rpc_get_methods" => {
                params::<NoParams>(&p)?;
                Ok(json!(METHODS))
            }
            other => Err(RpcError::new(
                METHOD_NOT_FOUND,
                format!("method not found: {other}"),
            )),
        }
    }

    /// Subsystem `nqn` as it is now.
    fn info(&self, nqn: &str) -> Result<SubsystemInfo, RpcError> {
        self.handle
            .subsystems()
            .into_iter()
            .find(|s| s.nqn == nqn)
            .ok_or_else(|| RpcError::new(TARGET_REFUSED, format!("no subsystem {nqn}")))
    }
}

/// A client of the control socket (what the `nvpoll-rpc` tool is).
#[derive(Debug)]
pub struct RpcClient {
    stream: UnixStream,
    buf: Vec<u8>,
    next_id: u64,
}

impl RpcClient {
    /// Connects to the control socket at `path`; each call waits up to 30 s for its answer.
    pub fn connect(path: &Path) -> Result<RpcClient, Error> {
        let stream = UnixStream::connect(path)
            .map_err(|e| Error::io(format!("connect to {}", path.display()), e))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| Error::io("set the socket's timeout", e))?;
        Ok(RpcClient {
            stream,
            buf: Vec::new(),
            next_id: 1,
        })
    }

    /// Calls `method`: `Err` if the socket failed, `Ok(Err)` with the server's error if it refused.
    pub fn call(
        &mut self,
        method: &str,
        params: Option<Value>,
    ) -> Result<Result<Value, RpcError>, Error> {
        let id = self.next_id;
        self.next_id += 1;
        let mut request = json!({"jsonrpc": "2.0", "id": id, "method": method});
        if let Some(p) = params {
            request["params"] = p;
        }
        send(&mut self.stream, &request).map_err(|e| Error::io("send the request", e))?;
        let mut answer = self.receive()?;
        if answer.get("id") != Some(&json!(id)) {
            return Err(Error::RpcAnswer(format!(
                "an answer for another request: {answer}"
            )));
        }
        if let Some(e) = answer.get("error") {
            return Ok(Err(RpcError {
                code: e.get("code").and_then(Value::as_i64).unwrap_or(0),
                message: e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("(no message)")
                    .to_string(),
            }));
        }
        match answer.get_mut("result") {
            Some(r) => Ok(Ok(r.take())),
            None => Err(Error::RpcAnswer(format!(
                "an answer with neither result nor error: {answer}"
            ))),
        }
    }

    /// The next JSON value from the server.
    fn receive(&mut self) -> Result<Value, Error> {
        let mut chunk = [0u8; 8192];
        loop {
            let mut values = serde_json::Deserializer::from_slice(&self.buf).into_iter::<Value>();
            match values.next() {
                Some(Ok(v)) => {
                    let used = values.byte_offset();
                    self.buf.drain(..used);
                    return Ok(v);
                }
                Some(Err(e)) if !e.is_eof() => return Err(Error::RpcJson(e)),
                _ => {}
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(Error::RpcClosed),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(Error::RpcTimeout)
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("receive the answer", e)),
            }
        }
    }
}
