//! The control-socket client of nvpoll's NVMe/TCP target (nvpoll-target with --rpc-socket): calls one
//! JSON-RPC method and prints its result.
//!
//! ```text
//! cargo run --bin nvpoll-rpc -- -s /var/tmp/nvpoll.sock subsystem_list
//! cargo run --bin nvpoll-rpc -- -s /var/tmp/nvpoll.sock namespace_add nqn=nqn.2024-01.io.nvpoll:a ram=1G
//! cargo run --bin nvpoll-rpc -- -s /var/tmp/nvpoll.sock subsystem_add '{"nqn": "nqn.2024-01.io.nvpoll:b", "allow_any_host": true, "namespaces": [{"ram": "64M"}]}'
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use nvpoll_target::rpc::serde_json::{self, Map, Value};
use nvpoll_target::rpc::RpcClient;

/// nvpoll target control: calls one JSON-RPC method on a running target's control socket and prints the result.
///
/// The target serves the socket when started with --rpc-socket PATH. `rpc_get_methods` lists the methods;
/// docs/target.md describes the socket and nvmf-target/src/rpc.rs each method. A JSON-RPC error is printed
/// on stderr, with exit status 1; a socket that cannot be reached gives exit status 2.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The target's control socket (its --rpc-socket).
    #[arg(short = 's', long = "socket", default_value = "/var/tmp/nvpoll.sock")]
    socket: PathBuf,

    /// The method, such as subsystem_list, subsystem_add, namespace_add, host_add or stats_get.
    method: String,

    /// The params: one JSON object, or KEY=VALUE pairs made into one. A VALUE of digits is a number, true and
    /// false are booleans, one that starts with [, { or " is read as JSON (so '"0001"' is a string), and
    /// anything else is a string.
    #[arg(value_name = "PARAMS")]
    params: Vec<String>,
}

/// A KEY=VALUE pair's value, typed.
fn typed(v: &str) -> Value {
    match v {
        "true" => return Value::Bool(true),
        "false" => return Value::Bool(false),
        _ => {}
    }
    if v.starts_with(['[', '{', '"']) {
        if let Ok(json) = serde_json::from_str(v) {
            return json;
        }
    }
    if let Ok(n) = v.parse::<u64>() {
        return Value::from(n);
    }
    if let Ok(n) = v.parse::<i64>() {
        return Value::from(n);
    }
    Value::String(v.to_string())
}

fn params(args: &[String]) -> Result<Option<Value>, String> {
    match args {
        [] => Ok(None),
        [one] if one.trim_start().starts_with('{') => serde_json::from_str(one)
            .map(Some)
            .map_err(|e| format!("PARAMS is not a JSON object: {e}")),
        pairs => {
            let mut object = Map::new();
            for pair in pairs {
                let (key, value) = pair
                    .split_once('=')
                    .ok_or_else(|| format!("{pair:?}: expected KEY=VALUE, or one JSON object"))?;
                if object.insert(key.to_string(), typed(value)).is_some() {
                    return Err(format!("{key} is given twice"));
                }
            }
            Ok(Some(Value::Object(object)))
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let params = match params(&args.params) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("nvpoll-rpc: {e}");
            return ExitCode::from(2);
        }
    };
    let answer = RpcClient::connect(&args.socket).and_then(|mut c| c.call(&args.method, params));
    match answer {
        Ok(Ok(result)) => {
            let text = serde_json::to_string_pretty(&result).unwrap_or_else(|_| result.to_string());
            println!("{text}");
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            eprintln!(
                "nvpoll-rpc: {}: {} (code {})",
                args.method, e.message, e.code
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("nvpoll-rpc: {e}");
            ExitCode::from(2)
        }
    }
}
