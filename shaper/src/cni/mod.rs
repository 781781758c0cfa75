//! `shaper-cni`: a chained CNI plugin that takes the reference `bandwidth` plugin's
//! configuration (`runtimeConfig.bandwidth` or top-level `ingressRate`, `ingressBurst`,
//! `egressRate`, `egressBurst`; rates in bit/s, bursts in bits) and limits the container
//! with shaper classes on its host-side veth: container ingress is the host veth's
//! egress, container egress the host veth's ingress, or with `egressAction: "shape"`
//! the container's own interface's egress inside its namespace.
//!
//! ADD attaches and adds the classes (idempotent), CHECK verifies the kernel still
//! matches, DEL detaches what ADD made and succeeds when there is nothing to remove.
//! The interfaces' names are kept in /run/shaper/cni so DEL finds them after the
//! container's namespace is gone.

use crate::{
    config::{self, Desired, Prune},
    netns, state,
};
use anyhow::{anyhow, bail, Context as _, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

mod limits;
pub use limits::{desired, Bandwidth, Container, NetConf};

pub(crate) const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0"];
/// Where ADD records the host-side interface of each container attachment.
const RECORD_DIR: &str = "/run/shaper/cni";
/// Class names shaper-cni owns on the host veth (and the container's interface).
pub(crate) const INGRESS_CLASS: &str = "cni-ingress";
pub(crate) const EGRESS_CLASS: &str = "cni-egress";

/// CNI error codes (spec section "Error"): well-known ones and shaper's own (>= 100).
pub(crate) const ERR_INCOMPATIBLE_VERSION: u32 = 1;
pub(crate) const ERR_INVALID_ENV: u32 = 4;
pub(crate) const ERR_DECODE: u32 = 6;
pub(crate) const ERR_INVALID_CONFIG: u32 = 7;
pub(crate) const ERR_SHAPER: u32 = 100;

/// A failure with its CNI error code.
#[derive(Debug)]
pub(crate) struct CniError {
    pub code: u32,
    pub message: String,
}

impl std::fmt::Display for CniError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CniError {}

fn cni_error(code: u32, message: impl Into<String>) -> anyhow::Error {
    CniError {
        code,
        message: message.into(),
    }
    .into()
}

/// The CNI_* environment.
pub struct Env {
    pub command: String,
    pub container_id: String,
    pub netns: Option<String>,
    pub ifname: String,
}

impl Env {
    pub fn from_process() -> Result<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let command = var("CNI_COMMAND")
            .ok_or_else(|| cni_error(ERR_INVALID_ENV, "CNI_COMMAND is not set"))?;
        let needs = |name: &str| {
            var(name).ok_or_else(|| cni_error(ERR_INVALID_ENV, format!("{name} is not set")))
        };
        Ok(Self {
            container_id: if command == "VERSION" {
                String::new()
            } else {
                needs("CNI_CONTAINERID")?
            },
            ifname: if command == "VERSION" {
                String::new()
            } else {
                needs("CNI_IFNAME")?
            },
            netns: var("CNI_NETNS"),
            command,
        })
    }
}

/// The host-side peer of the container's veth `ifname` in the namespace at `path`.
fn host_peer(path: &str, ifname: &str) -> Result<String> {
    let link_index = netns::in_path(path, || {
        let links = ip_links(&["link", "show", "dev", ifname])?;
        links
            .first()
            .and_then(|link| link["link_index"].as_u64())
            .ok_or_else(|| anyhow!("{ifname} in {path} is not a veth with a peer"))
    })?;
    let links = ip_links(&["link", "show"])?;
    links
        .iter()
        .find(|link| link["ifindex"].as_u64() == Some(link_index))
        .and_then(|link| link["ifname"].as_str().map(str::to_string))
        .ok_or_else(|| {
            anyhow!("the host side of {ifname} (ifindex {link_index}) is not in this namespace")
        })
}

fn ip_links(args: &[&str]) -> Result<Vec<Value>> {
    let output = std::process::Command::new("ip")
        .arg("-j")
        .args(args)
        .output()
        .context("cannot run ip (iproute2)")?;
    if !output.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(serde_json::from_slice(&output.stdout)?)
}

fn record_path(env: &Env) -> PathBuf {
    let safe = |s: &str| s.replace(['/', '.'], "_");
    PathBuf::from(RECORD_DIR).join(format!("{}-{}", safe(&env.container_id), safe(&env.ifname)))
}

/// The record's text: the host veth, then the container's namespace and interface.
fn record_text(dev: &str, container: Option<&Container>) -> String {
    match container {
        Some(container) => format!("{dev}\n{} {}\n", container.netns, container.ifname),
        None => format!("{dev}\n"),
    }
}

/// The interfaces (netns, dev) a record names.
fn recorded_interfaces(text: &str) -> Vec<(Option<String>, String)> {
    let mut lines = text.lines().map(str::trim).filter(|line| !line.is_empty());
    let mut interfaces: Vec<(Option<String>, String)> = lines
        .next()
        .map(|dev| (None, dev.to_string()))
        .into_iter()
        .collect();
    if let Some((netns, ifname)) = lines.next().and_then(|line| line.rsplit_once(' ')) {
        interfaces.push((Some(netns.to_string()), ifname.to_string()));
    }
    interfaces
}

/// The container's side, when its namespace is a named one (`/run/netns/NAME`, as
/// containerd, CRI-O and Podman make them): shaper reaches interfaces by namespace name.
fn container(env: &Env) -> Option<Container> {
    let path = Path::new(env.netns.as_deref()?);
    let named = path.parent()?.canonicalize().ok()?
        == Path::new(netns::NETNS_RUN_DIR).canonicalize().ok()?;
    let name = path.file_name()?.to_str()?;
    (named && netns::check_netns_name(name).is_ok()).then(|| Container {
        netns: name.to_string(),
        ifname: env.ifname.clone(),
    })
}

/// The prevResult, checked to name the host interface when there is one.
fn prev_result(conf: &NetConf) -> Result<Value> {
    conf.prev_result.clone().ok_or_else(|| {
        cni_error(
            ERR_INVALID_CONFIG,
            "shaper-cni is a chained plugin: it needs a prevResult (put it after bridge or ptp)",
        )
    })
}

fn host_interface(conf: &NetConf, env: &Env) -> Result<String> {
    let path = env
        .netns
        .as_deref()
        .ok_or_else(|| cni_error(ERR_INVALID_ENV, "CNI_NETNS is not set"))?;
    let dev = host_peer(path, &env.ifname).map_err(|e| cni_error(ERR_SHAPER, format!("{e:#}")))?;
    let listed = prev_result(conf)?["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|i| i["name"] == dev.as_str() && i["sandbox"].as_str().unwrap_or("").is_empty());
    if !listed {
        bail!(cni_error(
            ERR_INVALID_CONFIG,
            format!("the host interface {dev} is not in prevResult.interfaces")
        ));
    }
    Ok(dev)
}

/// Runs one CNI command; returns what to print on stdout.
pub fn run(env: &Env, stdin: &[u8]) -> Result<Value> {
    if env.command == "VERSION" {
        let version = NetConf::parse(stdin)
            .map(|c| c.cni_version)
            .unwrap_or_else(|_| "1.0.0".into());
        return Ok(json!({"cniVersion": version, "supportedVersions": SUPPORTED_VERSIONS}));
    }
    let conf = NetConf::parse(stdin)?;
    crate::caps::require().map_err(|e| cni_error(ERR_SHAPER, format!("{e:#}")))?;
    let shaper = |e: anyhow::Error| cni_error(ERR_SHAPER, format!("{e:#}"));
    match env.command.as_str() {
        "ADD" => {
            let mut result = prev_result(&conf)?;
            let dev = host_interface(&conf, env)?;
            let container = container(env);
            if let Some(wanted) = desired(&conf, &dev, container.as_ref())? {
                let _lock = state::lock().map_err(shaper)?;
                let plan = config::plan(&wanted, Prune::Nothing).map_err(shaper)?;
                std::fs::create_dir_all(RECORD_DIR).map_err(|e| shaper(e.into()))?;
                std::fs::write(record_path(env), record_text(&dev, container.as_ref()))
                    .map_err(|e| shaper(e.into()))?;
                config::execute(&plan).map_err(shaper)?;
            }
            result["cniVersion"] = json!(conf.cni_version);
            Ok(result)
        }
        "CHECK" => {
            let dev = host_interface(&conf, env)?;
            if let Some(wanted) = desired(&conf, &dev, container(env).as_ref())? {
                let plan = config::plan(&wanted, Prune::Nothing).map_err(shaper)?;
                if !plan.steps.is_empty() {
                    let steps: Vec<String> = plan.steps.iter().map(|s| s.to_string()).collect();
                    bail!(cni_error(
                        ERR_SHAPER,
                        format!("{dev} is not as configured: {}", steps.join("; "))
                    ));
                }
            }
            Ok(Value::Null)
        }
        "DEL" => {
            let record = record_path(env);
            let Ok(text) = std::fs::read_to_string(&record) else {
                return Ok(Value::Null); // nothing was added, or already deleted
            };
            let _lock = state::lock().map_err(shaper)?;
            let ours = recorded_interfaces(&text);
            let plan = config::plan(&Desired::default(), Prune::These(&ours)).map_err(shaper)?;
            config::execute(&plan).map_err(shaper)?;
            std::fs::remove_file(&record).map_err(|e| shaper(e.into()))?;
            Ok(Value::Null)
        }
        other => bail!(cni_error(
            ERR_INVALID_ENV,
            format!("unknown CNI_COMMAND '{other}'")
        )),
    }
}

/// The CNI error object for a failure.
pub fn error_json(version: &str, error: &anyhow::Error) -> Value {
    let (code, message) = match error.downcast_ref::<CniError>() {
        Some(e) => (e.code, e.message.clone()),
        None => (ERR_SHAPER, format!("{error:#}")),
    };
    json!({"cniVersion": version, "code": code, "msg": crate::error::one_line(&message)})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_answers_in_the_version_the_runtime_speaks() {
        let env = Env {
            command: "VERSION".into(),
            container_id: String::new(),
            netns: None,
            ifname: String::new(),
        };
        for version in ["0.4.0", "1.0.0"] {
            let stdin = format!(r#"{{"cniVersion":"{version}"}}"#);
            let answer = run(&env, stdin.as_bytes()).unwrap();
            assert_eq!(answer["cniVersion"], version);
            assert!(answer["supportedVersions"]
                .as_array()
                .unwrap()
                .contains(&json!(version)));
        }
    }

    #[test]
    fn a_record_names_the_host_veth_and_the_containers_interface() {
        let container = Container {
            netns: "cni-1".into(),
            ifname: "eth0".into(),
        };
        assert_eq!(
            recorded_interfaces(&record_text("veth1", Some(&container))),
            vec![
                (None, "veth1".into()),
                (Some("cni-1".into()), "eth0".into())
            ]
        );
        // Records written before egressAction shape hold the host veth alone.
        assert_eq!(
            recorded_interfaces("veth1"),
            vec![(None, "veth1".to_string())]
        );
    }
}
