//! The target's control socket: every method round-trips; bad requests get their JSON-RPC error and change
//! nothing; concatenated, batched and notification requests; the socket file is private, single and removed
//! at stop; and what the RPCs change is what our initiator sees (subsystems, hosts, namespaces, listeners,
//! TLS keys), with no key ever in an answer.

use nvpoll_testkit::target as target_common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::spec::Status;
use nvpoll_target::rpc::serde_json::{self, json, Value};
use nvpoll_target::rpc::{self, RpcClient, RpcError, RpcServer, ServeOptions};
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use target_common::{pool, TestTarget, NQN};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
/// The base64 part of KEY: what no answer may contain.
const KEY_BODY: &str = "VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ";
const A: &str = "nqn.2024-01.io.nvpoll:a";
const H1: &str = "nqn.2024-01.io.nvpoll:h1";
const H2: &str = "nqn.2024-01.io.nvpoll:h2";
const H3: &str = "nqn.2024-01.io.nvpoll:h3";

/// A folder of its own for one test, removed at the end.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("nvpoll-rpc-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn key_file(&self, name: &str, mode: u32) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, format!("{KEY}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A target (the test subsystem NQN, any host, two RAM namespaces) with a control socket and a client.
/// Fields drop in order: the server stops before the target.
struct Fixture {
    client: RpcClient,
    server: RpcServer,
    changes: Arc<Mutex<Vec<String>>>,
    t: TestTarget,
    dir: TempDir,
}

impl Fixture {
    fn new(name: &str) -> Fixture {
        let dir = TempDir::new(name);
        let t = TestTarget::start(|c| c);
        let changes = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&changes);
        let options = ServeOptions {
            on_change: Some(Arc::new(move |line: &str| {
                sink.lock().unwrap().push(line.to_string())
            })),
            ..ServeOptions::default()
        };
        let server = rpc::serve(&dir.0.join("ctl.sock"), t.handle.clone(), options).unwrap();
        let client = RpcClient::connect(server.path()).unwrap();
        Fixture {
            client,
            server,
            changes,
            t,
            dir,
        }
    }

    fn try_call(&mut self, method: &str, params: Value) -> Result<Value, RpcError> {
        let params = (!params.is_null()).then_some(params);
        let answer = self.client.call(method, params).expect("the socket works");
        if let Ok(v) = &answer {
            assert!(!v.to_string().contains(KEY_BODY), "{method} answered a key");
        }
        answer
    }

    fn call(&mut self, method: &str, params: Value) -> Value {
        self.try_call(method, params.clone())
            .unwrap_or_else(|e| panic!("{method} {params}: {e}"))
    }

    fn refused(&mut self, method: &str, params: Value, code: i64) -> RpcError {
        match self.try_call(method, params.clone()) {
            Err(e) => {
                assert_eq!(e.code, code, "{method} {params}: {e}");
                assert!(!e.message.contains(KEY_BODY));
                e
            }
            Ok(v) => panic!("{method} {params} was accepted: {v}"),
        }
    }

    /// Subsystem `nqn` as subsystem_list shows it.
    fn subsystem(&mut self, nqn: &str) -> Value {
        let list = self.call("subsystem_list", Value::Null);
        list.as_array()
            .unwrap()
            .iter()
            .find(|s| s["nqn"] == nqn)
            .cloned()
            .unwrap_or_else(|| panic!("{nqn} not in {list}"))
    }

    /// Everything the RPCs can change.
    fn state(&mut self) -> (Value, Value) {
        (
            self.call("subsystem_list", Value::Null),
            self.call("listener_list", Value::Null),
        )
    }
}

/// Our initiator's options, with a generous time for each step (the machine may be busy with other tests).
fn opts(addr: SocketAddr, subnqn: &str, hostnqn: &str) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, subnqn, hostnqn);
    o.timeout = Duration::from_secs(30);
    o
}

fn attach(
    addr: SocketAddr,
    subnqn: &str,
    hostnqn: &str,
) -> Result<TcpController, nvpoll_tcp::Error> {
    TcpController::connect(opts(addr, subnqn, hostnqn), pool())
}

fn assert_refused(r: Result<TcpController, nvpoll_tcp::Error>, what: &str) {
    match r {
        Err(nvpoll_tcp::Error::Refused(r)) => {
            assert!(
                r.status.is(Status::CONNECT_INVALID_PARAMETERS)
                    || r.status.is(Status::CONNECT_INVALID_HOST),
                "{what}: {r:?}"
            )
        }
        Err(e) => panic!("{what}: expected a refused Connect, got {e:?}"),
        Ok(_) => panic!("{what}: the host got in"),
    }
}

#[test]
fn every_method_round_trips() {
    let mut f = Fixture::new("methods");
    let methods = f.call("rpc_get_methods", Value::Null);
    assert_eq!(methods, json!(rpc::METHODS));

    // Listeners.
    let listeners = f.call("listener_list", Value::Null);
    assert_eq!(
        listeners,
        json!([{"address": f.t.addr.to_string(), "tls": "off"}])
    );
    let added = f.call(
        "listener_add",
        json!({"address": "127.0.0.1:0", "tls": "optional"}),
    );
    let extra: SocketAddr = added["address"].as_str().unwrap().parse().unwrap();
    assert_ne!(extra.port(), 0, "the real port");
    assert_eq!(
        f.call("listener_list", Value::Null)[1],
        json!({"address": extra.to_string(), "tls": "optional"})
    );
    assert_eq!(
        f.call("listener_remove", json!({"address": extra.to_string()})),
        json!(true)
    );
    assert_eq!(f.call("listener_list", Value::Null), listeners);

    // Subsystems.
    let subsystem = json!({
        "nqn": A, "serial": "RPC1", "model": "made over rpc",
        "hosts": [{"nqn": H1}],
        "max_io_queues": 4, "queue_size": 32, "mdts": 6,
        "namespaces": [{"ram": "1M"}]
    });
    assert_eq!(f.call("subsystem_add", subsystem), json!(true));
    assert_eq!(
        f.subsystem(A),
        json!({
            "nqn": A, "serial": "RPC1", "model": "made over rpc",
            "allow_any_host": false, "hosts": [H1], "hosts_with_keys": [],
            "namespaces": [{"nsid": 1, "block_size": 512, "blocks": 2048, "backing": "RAM",
                            "ana_group": 1}],
            "listeners": null, "max_io_queues": 4, "queue_size": 32, "mdts": 6, "controllers": 0,
            "ana": []
        })
    );
    assert_eq!(f.subsystem(NQN)["allow_any_host"], json!(true));

    // Namespaces.
    assert_eq!(
        f.call(
            "namespace_add",
            json!({"nqn": A, "ram": 8192 * 4, "block_size": 4096})
        ),
        json!({"nsid": 2})
    );
    assert_eq!(
        f.call("namespace_add", json!({"nqn": A, "nsid": 9, "ram": "64K"})),
        json!({"nsid": 9})
    );
    assert_eq!(
        f.subsystem(A)["namespaces"][1],
        json!({"nsid": 2, "block_size": 4096, "blocks": 8, "backing": "RAM", "ana_group": 1})
    );
    f.call("namespace_remove", json!({"nqn": A, "nsid": 2}));
    let nsids: Vec<u64> = f.subsystem(A)["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["nsid"].as_u64().unwrap())
        .collect();
    assert_eq!(nsids, [1, 9]);

    // ANA states, per listener and group.
    let path = f.t.addr.to_string();
    assert_eq!(
        f.call(
            "ana_state_set",
            json!({"nqn": A, "listener": path, "group": 1, "state": "inaccessible"})
        ),
        json!({"before": "optimized", "state": "inaccessible"})
    );
    assert_eq!(
        f.subsystem(A)["ana"],
        json!([{"listener": path, "group": 1, "state": "inaccessible"}])
    );
    assert_eq!(
        f.call(
            "ana_state_set",
            json!({"nqn": A, "listener": path, "state": "optimized"})
        ),
        json!({"before": "inaccessible", "state": "optimized"})
    );
    assert_eq!(f.subsystem(A)["ana"], json!([]));

    // Hosts and keys.
    let key = f.dir.key_file("h3.key", 0o600);
    f.call("host_add", json!({"nqn": A, "host": H2}));
    f.call(
        "host_add",
        json!({"nqn": A, "host": H3, "psk_file": key.to_str().unwrap()}),
    );
    assert_eq!(f.subsystem(A)["hosts"], json!([H1, H2, H3]));
    assert_eq!(f.subsystem(A)["hosts_with_keys"], json!([H3]));
    f.call("host_remove", json!({"nqn": A, "host": H3}));
    assert_eq!(f.subsystem(A)["hosts"], json!([H1, H2]));
    assert_eq!(f.subsystem(A)["hosts_with_keys"], json!([]));
    f.call(
        "key_set",
        json!({"nqn": A, "host": H1, "psk_file": key.to_str().unwrap()}),
    );
    assert_eq!(f.subsystem(A)["hosts_with_keys"], json!([H1]));
    f.call("key_remove", json!({"nqn": A, "host": H1}));
    assert_eq!(f.subsystem(A)["hosts_with_keys"], json!([]));
    f.call("subsystem_allow_any_host", json!({"nqn": A, "allow": true}));
    assert_eq!(f.subsystem(A)["allow_any_host"], json!(true));
    f.call(
        "subsystem_allow_any_host",
        json!({"nqn": A, "allow": false}),
    );
    assert_eq!(
        (
            f.subsystem(A)["allow_any_host"].clone(),
            f.subsystem(A)["hosts"].clone()
        ),
        (json!(false), json!([]))
    );

    // Counters.
    let stats = f.call("stats_get", Value::Null);
    for field in [
        "accepted",
        "closed",
        "commands",
        "reads",
        "writes",
        "bytes_read",
        "bytes_written",
        "errors",
        "r2ts",
        "term_reqs",
        "connects_rejected",
        "keep_alive_expired",
        "dropped",
        "internal_errors",
        "aers_retired",
    ] {
        assert!(stats[field].is_u64(), "{field} in {stats}");
    }
    let before = stats["accepted"].as_u64().unwrap();
    drop(attach(f.t.addr, NQN, H1).expect("attach"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.call("stats_get", Value::Null)["accepted"]
        .as_u64()
        .unwrap()
        <= before
    {
        assert!(
            Instant::now() < deadline,
            "stats_get never counted the connection"
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    assert_eq!(f.call("subsystem_remove", json!({"nqn": A})), json!(true));
    let nqns: Vec<Value> = f
        .call("subsystem_list", Value::Null)
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["nqn"].clone())
        .collect();
    assert_eq!(nqns, [json!(NQN)]);

    // Each change was told, in order, by method and subject; none with a key.
    let changes = f.changes.lock().unwrap().clone();
    assert_eq!(changes.len(), 16, "{changes:#?}");
    assert!(
        changes[0].starts_with("listener_add 127.0.0.1:"),
        "{}",
        changes[0]
    );
    assert_eq!(changes[2], format!("subsystem_add {A}"));
    assert_eq!(changes[3], format!("namespace_add {A} nsid 2"));
    assert_eq!(
        changes[6],
        format!("ana_state_set {A} listener {path} group 1: optimized -> inaccessible")
    );
    assert_eq!(changes[9], format!("host_add {A} host {H3} with a key"));
    assert_eq!(changes[15], format!("subsystem_remove {A}"));
    assert!(changes
        .iter()
        .all(|c| !c.contains(KEY_BODY) && !c.contains("NVMeTLSkey")));
}

#[test]
fn bad_requests_get_their_error_and_change_nothing() {
    let mut f = Fixture::new("bad");
    f.call(
        "subsystem_add",
        json!({"nqn": A, "hosts": [{"nqn": H1}], "namespaces": [{"ram": "1M"}]}),
    );
    let before = f.state();
    let open_key = f.dir.key_file("open.key", 0o644);
    let missing = f.dir.0.join("missing.key");

    use rpc::{INVALID_PARAMS as P, METHOD_NOT_FOUND, TARGET_REFUSED as R};
    f.refused("nvmf_create_subsystem", json!({"nqn": A}), METHOD_NOT_FOUND);
    // Params the methods do not take, or of the wrong type.
    let e = f.refused(
        "namespace_add",
        json!({"nqn": A, "ram": "1M", "size": 5}),
        P,
    );
    assert!(e.message.contains("unknown field `size`"), "{e}");
    let e = f.refused(
        "namespace_add",
        json!({"nqn": A, "ram": "1M", "file": "/dev/null"}),
        P,
    );
    assert!(
        e.message.contains("file: a namespace has one of ram"),
        "{e}"
    );
    f.refused("namespace_add", json!({"nqn": A}), P);
    f.refused("namespace_add", json!({"ram": "1M"}), P);
    f.refused("namespace_remove", json!({"nqn": A, "nsid": "one"}), P);
    let e = f.refused(
        "ana_state_set",
        json!({"nqn": A, "listener": f.t.addr.to_string(), "state": "optimised"}),
        P,
    );
    assert!(e.message.contains("must be one of optimized"), "{e}");
    f.refused("listener_add", json!({"address": "localhost"}), P);
    f.refused(
        "listener_add",
        json!({"address": "127.0.0.1:0", "tls": "maybe"}),
        P,
    );
    f.refused("stats_get", json!({"verbose": true}), P);
    f.refused("subsystem_allow_any_host", json!({"nqn": A}), P);
    let e = f.refused(
        "subsystem_add",
        json!({"nqn": "nqn.2024-01.io.nvpoll:b", "namespaces": [{"ram": "1M"}, {"ram": "1X"}]}),
        P,
    );
    assert!(e.message.starts_with("namespaces[1].ram: "), "{e}");
    let e = f.refused("subsystem_add", json!({"nqn": "bad nqn"}), P);
    assert!(e.message.starts_with("nqn: "), "{e}");
    f.refused(
        "subsystem_add",
        json!({"nqn": "nqn.2024-01.io.nvpoll:b", "listeners": ["127.0.0.1:1"]}),
        P,
    );
    // A key file others may read: refused, named, not quoted, and the host is not allowed either.
    let e = f.refused(
        "host_add",
        json!({"nqn": A, "host": H2, "psk_file": open_key.to_str().unwrap()}),
        P,
    );
    assert!(
        e.message.contains("chmod 600") && e.message.contains("0644"),
        "{e}"
    );
    f.refused(
        "key_set",
        json!({"nqn": A, "host": H1, "psk_file": missing.to_str().unwrap()}),
        P,
    );
    f.refused("host_add", json!({"nqn": A, "host": "not an nqn"}), P);
    // Well-formed, but the target says no.
    let e = f.refused(
        "subsystem_remove",
        json!({"nqn": "nqn.2024-01.io.nvpoll:nope"}),
        R,
    );
    assert!(
        e.message
            .contains("no subsystem nqn.2024-01.io.nvpoll:nope"),
        "{e}"
    );
    f.refused("subsystem_add", json!({"nqn": A}), R);
    f.refused("namespace_remove", json!({"nqn": A, "nsid": 5}), R);
    let e = f.refused(
        "ana_state_set",
        json!({"nqn": A, "listener": "127.0.0.1:1", "state": "inaccessible"}),
        R,
    );
    assert!(e.message.contains("not a listener of the target"), "{e}");
    let e = f.refused(
        "ana_state_set",
        json!({"nqn": A, "listener": f.t.addr.to_string(), "group": 99, "state": "change"}),
        R,
    );
    assert!(e.message.contains("ANA group 99"), "{e}");
    f.refused(
        "namespace_add",
        json!({"nqn": A, "nsid": 1, "ram": "1M"}),
        R,
    );
    f.refused("listener_remove", json!({"address": "127.0.0.1:1"}), R);
    f.refused("listener_add", json!({"address": f.t.addr.to_string()}), R);
    f.refused("host_add", json!({"nqn": A, "host": H1}), R);
    f.refused("host_remove", json!({"nqn": A, "host": H3}), R);
    f.refused("key_remove", json!({"nqn": A, "host": H1}), R);
    let key = f.dir.key_file("h2.key", 0o600);
    f.refused(
        "host_add",
        json!({"nqn": "nqn.2024-01.io.nvpoll:nope", "host": H2, "psk_file": key.to_str().unwrap()}),
        R,
    );
    assert_eq!(f.state(), before, "nothing changed");
    assert_eq!(f.changes.lock().unwrap().len(), 1, "only the subsystem_add");

    // Requests that are not requests, on a raw stream.
    let mut s = UnixStream::connect(f.server.path()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut ask = |req: &str| -> Value {
        s.write_all(req.as_bytes()).unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let code = |v: &Value| v["error"]["code"].as_i64().unwrap();
    let a = ask(r#"{"jsonrpc": "2.0", "id": 1}"#);
    assert_eq!((code(&a), &a["id"]), (-32600, &json!(1)), "{a}");
    let a = ask(r#"{"jsonrpc": "1.0", "id": 2, "method": "stats_get"}"#);
    assert_eq!((code(&a), &a["id"]), (-32600, &json!(2)), "{a}");
    let a = ask(r#"{"jsonrpc": "2.0", "id": [3], "method": "stats_get"}"#);
    assert_eq!((code(&a), &a["id"]), (-32600, &Value::Null), "{a}");
    let a = ask(r#"{"jsonrpc": "2.0", "id": 4, "method": "stats_get", "extra": 1}"#);
    assert_eq!(code(&a), -32600, "{a}");
    let a = ask("5\n");
    assert_eq!(code(&a), -32600, "{a}");
    let a = ask("[]");
    assert_eq!(code(&a), -32600, "{a}");
    let a = ask(r#"{"jsonrpc": "2.0", "id": "s", "method": "subsystem_remove", "params": ["x"]}"#);
    assert_eq!((code(&a), &a["id"]), (-32602, &json!("s")), "{a}");
    assert_eq!(f.state(), before, "nothing changed");
}

#[test]
fn a_stream_that_is_not_json_gets_a_parse_error_and_is_closed() {
    let f = Fixture::new("parse");
    let mut s = UnixStream::connect(f.server.path()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(
        b"{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \"stats_get\"}\n{\"jsonrpc\": nope}\n",
    )
    .unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all)
        .expect("the server closes the stream");
    let answers: Vec<Value> = all
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(answers.len(), 2, "{all}");
    assert!(answers[0]["result"]["accepted"].is_u64(), "{all}");
    assert_eq!(answers[1]["error"]["code"], json!(-32700), "{all}");
    assert_eq!(answers[1]["id"], Value::Null, "{all}");
}

/// Reads `n` answer lines.
fn answers(r: &mut BufReader<UnixStream>, n: usize) -> Vec<Value> {
    (0..n)
        .map(|_| {
            let mut line = String::new();
            r.read_line(&mut line).expect("an answer");
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"))
        })
        .collect()
}

#[test]
fn concatenated_batched_and_notification_requests() {
    let mut f = Fixture::new("stream");
    f.call(
        "subsystem_add",
        json!({"nqn": A, "namespaces": [{"ram": "1M"}]}),
    );
    let mut s = UnixStream::connect(f.server.path()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let req = |id: u64, method: &str, params: Value| {
        json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string()
    };
    // Three requests back to back, no separators, the last cut in two writes.
    let three = format!(
        "{}{}{}",
        req(1, "listener_list", json!({})),
        req(2, "namespace_add", json!({"nqn": A, "ram": "1M"})),
        req(3, "namespace_add", json!({"nqn": A, "ram": "1M"}))
    );
    let (head, tail) = three.split_at(three.len() - 10);
    s.write_all(head.as_bytes()).unwrap();
    s.flush().unwrap();
    let got = answers(&mut r, 2);
    assert_eq!(got[0]["id"], json!(1));
    assert_eq!(
        got[1],
        json!({"jsonrpc": "2.0", "id": 2, "result": {"nsid": 2}})
    );
    s.write_all(tail.as_bytes()).unwrap();
    assert_eq!(answers(&mut r, 1)[0]["result"], json!({"nsid": 3}));

    // A batch: answers for the requests, none for the notification (which still runs), in one array.
    let notification = json!({"jsonrpc": "2.0", "method": "subsystem_allow_any_host", "params": {"nqn": A, "allow": false}});
    let batch = format!(
        "[{}, {notification}, {}, 7]\n",
        req(10, "namespace_remove", json!({"nqn": A, "nsid": 3})),
        req(11, "namespace_remove", json!({"nqn": A, "nsid": 3})),
    );
    s.write_all(batch.as_bytes()).unwrap();
    let got = answers(&mut r, 1).remove(0);
    let got = got.as_array().expect("a batch is answered with an array");
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got[0], json!({"jsonrpc": "2.0", "id": 10, "result": true}));
    assert_eq!(
        (&got[1]["id"], &got[1]["error"]["code"]),
        (&json!(11), &json!(-32000))
    );
    assert_eq!(
        (&got[2]["id"], &got[2]["error"]["code"]),
        (&Value::Null, &json!(-32600))
    );
    assert_eq!(f.subsystem(A)["allow_any_host"], json!(false));

    // Notifications alone (and a failing one) get no answer: the next line is the next request's.
    let notes = format!(
        "{}\n[{}]\n{}",
        json!({"jsonrpc": "2.0", "method": "subsystem_allow_any_host", "params": {"nqn": A, "allow": true}}),
        json!({"jsonrpc": "2.0", "method": "no_such_method"}),
        req(20, "rpc_get_methods", Value::Null).replace(",\"params\":null", ""),
    );
    s.write_all(notes.as_bytes()).unwrap();
    let got = answers(&mut r, 1).remove(0);
    assert_eq!(got["id"], json!(20), "{got}");
    assert_eq!(f.subsystem(A)["allow_any_host"], json!(true));
}

#[test]
fn the_socket_is_private_single_and_removed_at_stop() {
    let dir = TempDir::new("socket");
    let t = TestTarget::start(|c| c);
    let path = dir.0.join("ctl.sock");
    let server = rpc::serve(&path, t.handle.clone(), ServeOptions::default()).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
    // A second server on a live socket is refused, and the first still answers.
    let e = rpc::serve(&path, t.handle.clone(), ServeOptions::default()).unwrap_err();
    assert!(e.to_string().contains("already served"), "{e}");
    let mut c = RpcClient::connect(&path).unwrap();
    assert!(c.call("stats_get", None).unwrap().is_ok());
    drop(c);
    server.stop();
    assert!(!path.exists(), "the socket file is removed at stop");
    assert!(RpcClient::connect(&path).is_err());

    // A socket file nobody answers on (a server that died) is replaced.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let server = rpc::serve(&path, t.handle.clone(), ServeOptions::default()).unwrap();
    let mut c = RpcClient::connect(&path).unwrap();
    assert!(c.call("listener_list", None).unwrap().is_ok());
    drop(server);
    assert!(!path.exists(), "dropping the server removes the file too");

    // Anything else at the path is left alone.
    std::fs::write(&path, b"not a socket").unwrap();
    let e = rpc::serve(&path, t.handle.clone(), ServeOptions::default()).unwrap_err();
    assert!(e.to_string().contains("not a socket"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
}

#[test]
fn a_subsystem_made_over_rpc_serves_our_initiator_and_its_hosts_change_who_connects() {
    let mut f = Fixture::new("hosts");
    f.call(
        "subsystem_add",
        json!({"nqn": A, "hosts": [{"nqn": H1}], "namespaces": [{"ram": "4M"}]}),
    );
    let addr = f.t.addr;
    let mut c = attach(addr, A, H1).expect("H1 is allowed");
    assert_eq!(c.namespaces().len(), 1);
    let mut qp = c.create_queue_pair(4).unwrap();
    read_4k(&mut qp, 1, 512).expect("a read on the new subsystem");
    assert_refused(attach(addr, A, H2), "H2 before host_add");
    f.call("host_add", json!({"nqn": A, "host": H2}));
    drop(attach(addr, A, H2).expect("H2 after host_add"));
    f.call("host_remove", json!({"nqn": A, "host": H1}));
    assert_refused(attach(addr, A, H1), "H1 after host_remove");
    assert_refused(attach(addr, A, H3), "H3 before allow_any_host");
    f.call("subsystem_allow_any_host", json!({"nqn": A, "allow": true}));
    drop(attach(addr, A, H3).expect("H3 with any host allowed"));
    // The controllers of H2 and H3 go when the target sees their connections close; H1's stays.
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.subsystem(A)["controllers"] != json!(1) {
        assert!(
            Instant::now() < deadline,
            "controllers: {}",
            f.subsystem(A)["controllers"]
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    read_4k(&mut qp, 1, 512).expect("H1's controller stays");
    f.call("subsystem_remove", json!({"nqn": A}));
    assert_refused(attach(addr, A, H3), "a removed subsystem");
}

/// Reads 4 KiB at LBA 0 of `nsid` (blocks of `block_size`); the NVMe status if it failed.
fn read_4k(qp: &mut TcpQueuePair, nsid: u32, block_size: u32) -> Result<(), Status> {
    let buf = pool().alloc(4096).unwrap();
    qp.submit(IoRequest {
        op: IoOp::Read,
        nsid,
        lba: 0,
        blocks: 4096 / block_size,
        buf: Some(buf),
        tag: 1,
    })
    .map_err(|r| r.error)
    .unwrap();
    qp.flush().unwrap();
    let mut result = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    while result.is_none() {
        qp.process_completions(1, |_, c| {
            result = Some(match &c.result {
                Ok(_) => Ok(()),
                Err(nvpoll::Error::Nvme(s)) => Err(s.status),
                Err(e) => panic!("the read failed without a status: {e}"),
            })
        })
        .unwrap();
        assert!(Instant::now() < deadline, "no completion");
    }
    result.unwrap()
}

#[test]
fn namespaces_added_and_removed_over_rpc_are_seen_by_our_initiator() {
    let mut f = Fixture::new("namespaces");
    f.call(
        "subsystem_add",
        json!({"nqn": A, "allow_any_host": true, "namespaces": [{"ram": "4M"}]}),
    );
    let addr = f.t.addr;
    let mut first = attach(addr, A, H1).unwrap();
    let mut first_qp = first.create_queue_pair(4).unwrap();
    let added = f.call(
        "namespace_add",
        json!({"nqn": A, "ram": "8M", "block_size": 4096}),
    );
    assert_eq!(added, json!({"nsid": 2}));
    let mut second = attach(addr, A, H1).unwrap();
    let ids: Vec<(u32, u32, u64)> = second
        .namespaces()
        .iter()
        .map(|n| (n.nsid, n.block_size, n.blocks))
        .collect();
    assert_eq!(
        ids,
        [(1, 512, 8192), (2, 4096, 2048)],
        "a new controller sees it"
    );
    let mut second_qp = second.create_queue_pair(4).unwrap();
    read_4k(&mut second_qp, 2, 4096).expect("I/O on the new namespace");
    f.call("namespace_remove", json!({"nqn": A, "nsid": 1}));
    let status = read_4k(&mut first_qp, 1, 512).expect_err("the removed namespace");
    assert!(status.is(Status::INVALID_NAMESPACE), "{status:?}");
    read_4k(&mut second_qp, 2, 4096).expect("the other namespace still serves");
}

/// Connects to `addr` until it works (a listener just added is listening already; this only guards against
/// a busy machine), within 10 s.
fn wait_connectable(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{addr} never accepted a connection"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn listeners_added_and_removed_over_rpc() {
    let mut f = Fixture::new("listeners");
    let added = f.call("listener_add", json!({"address": "127.0.0.1:0"}));
    let extra: SocketAddr = added["address"].as_str().unwrap().parse().unwrap();
    wait_connectable(extra);
    let mut c = attach(extra, NQN, H1).expect("a host on the new listener");
    let mut qp = c.create_queue_pair(4).unwrap();
    read_4k(&mut qp, 1, 512).expect("I/O through the new listener");
    f.call("listener_remove", json!({"address": extra.to_string()}));
    // The acceptor closes the socket at its next poll: new connections are then refused.
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(extra).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the removed listener still accepts"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    read_4k(&mut qp, 1, 512).expect("the connections made through it stay");
    assert_eq!(
        f.call("listener_list", Value::Null)
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn a_host_key_set_over_rpc_lets_the_host_in_with_tls_and_is_never_answered() {
    let mut f = Fixture::new("keys");
    let added = f.call(
        "listener_add",
        json!({"address": "127.0.0.1:0", "tls": "required"}),
    );
    let tls_addr: SocketAddr = added["address"].as_str().unwrap().parse().unwrap();
    f.call(
        "subsystem_add",
        json!({"nqn": A, "hosts": [{"nqn": H1}], "namespaces": [{"ram": "4M"}]}),
    );
    wait_connectable(tls_addr);
    let key = ConfiguredKey::parse(KEY).unwrap();
    let tls = || opts(tls_addr, A, H1).with_tls_key(&key, IdentityVersion::V1);
    assert!(
        TcpController::connect(tls(), pool()).is_err(),
        "no key for H1 yet"
    );
    let file = f.dir.key_file("h1.key", 0o600);
    f.call(
        "key_set",
        json!({"nqn": A, "host": H1, "psk_file": file.to_str().unwrap()}),
    );
    let mut c =
        TcpController::connect(tls(), pool()).expect("H1 over TLS with the key set over RPC");
    let mut qp = c.create_queue_pair(4).unwrap();
    read_4k(&mut qp, 1, 512).expect("I/O over TLS");
    // No answer holds the key: not the list, not the stats (Fixture::try_call checks every answer too).
    let everything = format!(
        "{}{}{}",
        f.call("subsystem_list", Value::Null),
        f.call("stats_get", Value::Null),
        f.call("listener_list", Value::Null)
    );
    assert!(!everything.contains(KEY_BODY) && !everything.contains("NVMeTLSkey"));
    assert_eq!(f.subsystem(A)["hosts_with_keys"], json!([H1]));
    f.call("key_remove", json!({"nqn": A, "host": H1}));
    assert!(
        TcpController::connect(tls(), pool()).is_err(),
        "the key is gone"
    );
    let changes = f.changes.lock().unwrap().clone();
    assert!(changes.iter().all(|c| !c.contains(KEY_BODY)), "{changes:?}");
}

/// subsystem_set_max_io_queues: the live controllers are torn down (their connections close), and a host that
/// connects again is granted the new count (what blktests nvme/048 does with nvmet's attr_qid_max).
#[test]
fn a_new_io_queue_count_takes_effect_when_hosts_reconnect() {
    let mut f = Fixture::new("qid-max");
    let addr = f.t.addr;
    let ctrl = attach(addr, NQN, target_common::HOSTNQN).unwrap();
    let before = ctrl.io_queues_granted().expect("a grant");
    assert!(before > 3, "{before}");
    let (mut raw, _) = target_common::RawHost::admin_queue(addr, NQN, 0);
    let answer = f.call(
        "subsystem_set_max_io_queues",
        json!({"nqn": NQN, "max_io_queues": 3}),
    );
    assert_eq!(answer["controllers_torn_down"], 2);
    assert_eq!(f.subsystem(NQN)["max_io_queues"], 3);
    // The old controller's admin queue closes (expect_close panics if it stays open 5 s).
    raw.expect_close();
    drop(ctrl);
    let ctrl = attach(addr, NQN, target_common::HOSTNQN).unwrap();
    assert_eq!(ctrl.io_queues_granted(), Some(3));
    f.refused(
        "subsystem_set_max_io_queues",
        json!({"nqn": NQN, "max_io_queues": 0}),
        rpc::TARGET_REFUSED,
    );
    f.refused(
        "subsystem_set_max_io_queues",
        json!({"nqn": "nqn.2024-01.io.nvpoll:none", "max_io_queues": 4}),
        rpc::TARGET_REFUSED,
    );
    assert!(f
        .changes
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("subsystem_set_max_io_queues")));
}

#[test]
fn the_tls_key_update_count_is_set_and_checked() {
    let mut f = Fixture::new("keyupdate");
    assert_eq!(
        f.call("tls_key_update_set", json!({"records": 1000})),
        json!(true)
    );
    let e = f.refused(
        "tls_key_update_set",
        json!({"records": 0}),
        rpc::TARGET_REFUSED,
    );
    assert!(e.message.contains("8388608"), "{e}");
    f.refused(
        "tls_key_update_set",
        json!({"records": "many"}),
        rpc::INVALID_PARAMS,
    );
}
