//! The `shaper-cni` chained CNI plugin (see `shaper::cni`): reads the network
//! configuration on stdin and the CNI_* environment, prints a result or a CNI error
//! object on stdout, and exits non-zero on error, as the CNI spec asks.

use shaper::cni;
use std::io::Read as _;

fn main() {
    let mut stdin = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut stdin);
    let version = cni::NetConf::parse(&stdin)
        .map(|c| c.cni_version)
        .unwrap_or_else(|_| "1.0.0".into());
    let outcome = cni::Env::from_process().and_then(|env| cni::run(&env, &stdin));
    match outcome {
        Ok(serde_json::Value::Null) => {}
        Ok(result) => println!("{result}"),
        Err(error) => {
            println!("{}", cni::error_json(&version, &error));
            std::process::exit(1);
        }
    }
}
