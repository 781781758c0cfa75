//! `shaper-cni`: a chained CNI plugin that takes the reference `bandwidth` plugin's
//! configuration (`runtimeConfig.bandwidth` or top-level `ingressRate`, `ingressBurst`,
//! `egressRate`, `egressBurst`; rates in bit/s, bursts in bits) and limits the container
//! with shaper classes on its host-side veth: container ingress is the host veth's
//! egress, container egress the host veth's ingress.
//!
//! ADD attaches and adds the classes (idempotent), CHECK verifies the kernel still
//! matches, DEL detaches what ADD made and succeeds when there is nothing to remove.
//! The host veth's name is kept in /run/shaper/cni so DEL finds it after the container's
//! namespace is gone.

use crate::{
    class_input::ClassInput,
    classes::ClassSpec,
    config::{self, Desired, DesiredInterface, Prune},
    netns,
    state::{self, Direction},
    units::MAX_BURST_BYTES,
};
use anyhow::{anyhow, bail, Context as _, Result};
use serde::Deserialize;
use serde_json::{json, Value};
use shaper_common::{Action, DEFAULT_FLOW_TABLE_SIZE};
use std::path::PathBuf;

pub(crate) const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0"];
/// Where ADD records the host-side interface of each container attachment.
const RECORD_DIR: &str = "/run/shaper/cni";
/// Class names shaper-cni owns on the host veth.
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

#[derive(Deserialize, Default, Clone, Copy, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Bandwidth {
    pub ingress_rate: Option<u64>,
    pub ingress_burst: Option<u64>,
    pub egress_rate: Option<u64>,
    pub egress_burst: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RuntimeConfig {
    bandwidth: Option<Bandwidth>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConf {
    pub cni_version: String,
    #[serde(default)]
    pub name: String,
    #[serde(flatten)]
    pub bandwidth: Bandwidth,
    #[serde(default)]
    runtime_config: RuntimeConfig,
    /// What to do with traffic toward the container over its rate: drop (default),
    /// ecn or shape (the host veth's egress can queue).
    #[serde(default)]
    pub ingress_action: Option<String>,
    #[serde(default)]
    pub prev_result: Option<Value>,
}

impl NetConf {
    pub fn parse(text: &[u8]) -> Result<Self> {
        let conf: NetConf = serde_json::from_slice(text).map_err(|e| {
            cni_error(
                ERR_DECODE,
                format!("cannot decode the network configuration: {e}"),
            )
        })?;
        if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
            bail!(cni_error(
                ERR_INCOMPATIBLE_VERSION,
                format!(
                    "cniVersion {} is not supported (supported: {})",
                    conf.cni_version,
                    SUPPORTED_VERSIONS.join(", ")
                )
            ));
        }
        Ok(conf)
    }

    /// The runtime's `runtimeConfig.bandwidth` wins over the top-level keys, as in the
    /// reference plugin.
    pub fn limits(&self) -> Bandwidth {
        self.runtime_config.bandwidth.unwrap_or(self.bandwidth)
    }
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

fn check_limit(rate: Option<u64>, burst: Option<u64>, what: &str) -> Result<Option<(u64, u64)>> {
    match (rate.unwrap_or(0), burst.unwrap_or(0)) {
        (0, 0) => Ok(None),
        (0, _) | (_, 0) => bail!(cni_error(
            ERR_INVALID_CONFIG,
            format!("{what}Rate and {what}Burst must be set together")
        )),
        (rate, _) if !(8..=shaper_common::bucket::MAX_RATE_BITS_PER_SEC).contains(&rate) => {
            bail!(cni_error(
                ERR_INVALID_CONFIG,
                format!("{what}Rate {rate} is outside 8..=400e9 bit/s")
            ))
        }
        (rate, burst) => {
            // Bits to bytes; at least one full frame, at most what the bucket holds.
            let bytes = burst
                .div_ceil(8)
                .clamp(crate::units::MIN_BURST_BYTES, MAX_BURST_BYTES);
            Ok(Some((rate, bytes)))
        }
    }
}

/// A class of the plugin, filled in and checked as every front end's classes are.
fn class(
    name: &str,
    direction: Direction,
    rate: u64,
    burst: u64,
    action: Action,
) -> Result<(Direction, ClassSpec)> {
    ClassInput {
        name: Some(name.into()),
        direction: Some(direction.name().into()),
        rate: Some(format!("{rate}bit")),
        burst: Some(burst.to_string()),
        action: Some(action.name().into()),
        ..ClassInput::default()
    }
    .check()
    .map_err(|errors| cni_error(ERR_INVALID_CONFIG, errors[0].message.clone()))
}

/// What the configuration asks for on the host veth `dev`; None when it limits nothing.
pub fn desired(conf: &NetConf, dev: &str) -> Result<Option<Desired>> {
    let limits = conf.limits();
    let ingress = check_limit(limits.ingress_rate, limits.ingress_burst, "ingress")?;
    let egress = check_limit(limits.egress_rate, limits.egress_burst, "egress")?;
    let ingress_action = match conf.ingress_action.as_deref().unwrap_or("drop") {
        "drop" => Action::Drop,
        "ecn" => Action::Ecn,
        "shape" => Action::Shape,
        other => bail!(cni_error(
            ERR_INVALID_CONFIG,
            format!("ingressAction '{other}' is not drop, ecn or shape")
        )),
    };
    let mut interface = DesiredInterface {
        netns: None,
        dev: dev.into(),
        directions: Vec::new(),
        flow_table_size: DEFAULT_FLOW_TABLE_SIZE,
        attach_mode: None,
        classes: Vec::new(),
    };
    // Toward the container: the host veth's egress.
    if let Some((rate, burst)) = ingress {
        interface.directions.push(Direction::Egress);
        interface.classes.push(class(
            INGRESS_CLASS,
            Direction::Egress,
            rate,
            burst,
            ingress_action,
        )?);
    }
    // From the container: the host veth's ingress, where packets can only be policed.
    if let Some((rate, burst)) = egress {
        interface.directions.push(Direction::Ingress);
        interface.classes.push(class(
            EGRESS_CLASS,
            Direction::Ingress,
            rate,
            burst,
            Action::Drop,
        )?);
    }
    if interface.classes.is_empty() {
        return Ok(None);
    }
    Ok(Some(Desired {
        coordination: None,
        interfaces: vec![interface],
    }))
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
            if let Some(wanted) = desired(&conf, &dev)? {
                let _lock = state::lock().map_err(shaper)?;
                let plan = config::plan(&wanted, Prune::Nothing).map_err(shaper)?;
                std::fs::create_dir_all(RECORD_DIR).map_err(|e| shaper(e.into()))?;
                std::fs::write(record_path(env), &dev).map_err(|e| shaper(e.into()))?;
                config::execute(&plan).map_err(shaper)?;
            }
            result["cniVersion"] = json!(conf.cni_version);
            Ok(result)
        }
        "CHECK" => {
            let dev = host_interface(&conf, env)?;
            if let Some(wanted) = desired(&conf, &dev)? {
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
            let Ok(dev) = std::fs::read_to_string(&record) else {
                return Ok(Value::Null); // nothing was added, or already deleted
            };
            let _lock = state::lock().map_err(shaper)?;
            let ours = [(None, dev.trim().to_string())];
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

    fn conf(text: &str) -> NetConf {
        NetConf::parse(text.as_bytes()).unwrap()
    }

    #[test]
    fn runtime_config_wins_and_bits_become_bytes() {
        let c = conf(
            r#"{"cniVersion":"1.0.0","name":"n","type":"shaper-cni","ingressRate":1,"ingressBurst":1,
            "runtimeConfig":{"bandwidth":{"ingressRate":10000000,"ingressBurst":800000,"egressRate":2000000,"egressBurst":80}}}"#,
        );
        let wanted = desired(&c, "veth0").unwrap().unwrap();
        let interface = &wanted.interfaces[0];
        assert_eq!(
            interface.directions,
            vec![Direction::Egress, Direction::Ingress]
        );
        let (direction, ingress) = &interface.classes[0];
        assert_eq!(*direction, Direction::Egress);
        assert_eq!(
            (ingress.rate_bits_per_sec, ingress.burst_bytes),
            (10_000_000, 100_000)
        );
        // 80 bits is below one frame: raised to the minimum burst.
        assert_eq!(
            interface.classes[1].1.burst_bytes,
            crate::units::MIN_BURST_BYTES
        );
    }

    #[test]
    fn bad_configurations_get_cni_error_codes() {
        let code = |text: &str| -> u32 {
            let error = NetConf::parse(text.as_bytes())
                .and_then(|c| desired(&c, "v").map(|_| ()))
                .unwrap_err();
            error.downcast_ref::<CniError>().unwrap().code
        };
        assert_eq!(code(r#"{"cniVersion":"9.9.9"}"#), ERR_INCOMPATIBLE_VERSION);
        assert_eq!(code("not json"), ERR_DECODE);
        assert_eq!(
            code(r#"{"cniVersion":"1.0.0","ingressRate":1000000}"#),
            ERR_INVALID_CONFIG
        );
        assert_eq!(
            code(
                r#"{"cniVersion":"1.0.0","egressRate":1000000,"egressBurst":8000,"ingressAction":"x"}"#
            ),
            ERR_INVALID_CONFIG
        );
    }

    #[test]
    fn no_limits_means_nothing_to_do() {
        let c = conf(r#"{"cniVersion":"0.4.0","name":"n"}"#);
        assert!(desired(&c, "v").unwrap().is_none());
    }
}
