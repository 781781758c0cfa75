//! The plugin's configuration (the reference `bandwidth` plugin's keys, and shaper's
//! `ingressAction` and `egressAction`) and the classes it asks for.

use super::{cni_error, ERR_DECODE, ERR_INCOMPATIBLE_VERSION, ERR_INVALID_CONFIG};
use super::{EGRESS_CLASS, INGRESS_CLASS, SUPPORTED_VERSIONS};
use crate::{
    class_input::ClassInput,
    classes::ClassSpec,
    config::{Desired, DesiredInterface},
    state::Direction,
    units::MAX_BURST_BYTES,
};
use anyhow::{bail, Result};
use serde::Deserialize;
use serde_json::Value;
use shaper_common::{Action, DEFAULT_FLOW_TABLE_SIZE};

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
    /// What to do with traffic from the container over its rate: drop (default), ecn, or
    /// shape (on the container's own interface's egress, inside its namespace).
    #[serde(default)]
    pub egress_action: Option<String>,
    /// With `ingressAction: "shape"`: how the container's class shares its rate among
    /// flows toward it: none (default), flow, src (each sending host first) or dst.
    #[serde(default)]
    pub ingress_fair: Option<String>,
    /// With `egressAction: "shape"`: how the container's upload shares its rate: none
    /// (default), flow, dst (each destination host first, then its flows) or src.
    #[serde(default)]
    pub egress_fair: Option<String>,
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
    (action, fair): (Action, Option<&str>),
) -> Result<(Direction, ClassSpec)> {
    ClassInput {
        name: Some(name.into()),
        direction: Some(direction.name().into()),
        rate: Some(format!("{rate}bit")),
        burst: Some(burst.to_string()),
        action: Some(action.name().into()),
        fair: fair.map(str::to_string),
        ..ClassInput::default()
    }
    .check()
    .map_err(|errors| cni_error(ERR_INVALID_CONFIG, errors[0].message.clone()))
}

/// The container's side: its network namespace's name (under /run/netns) and its
/// interface there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Container {
    pub netns: String,
    pub ifname: String,
}

fn action(value: Option<&str>, key: &str) -> Result<Action> {
    match value.unwrap_or("drop") {
        "drop" => Ok(Action::Drop),
        "ecn" => Ok(Action::Ecn),
        "shape" => Ok(Action::Shape),
        other => bail!(cni_error(
            ERR_INVALID_CONFIG,
            format!("{key} '{other}' is not drop, ecn or shape")
        )),
    }
}

fn interface(netns: Option<String>, dev: &str) -> DesiredInterface {
    DesiredInterface {
        netns,
        dev: dev.into(),
        directions: Vec::new(),
        flow_table_size: DEFAULT_FLOW_TABLE_SIZE,
        attach_mode: None,
        split_aggregates: false,
        classes: Vec::new(),
    }
}

/// Attaches `interface` in `direction` with class `name` limiting everything there.
fn limit(
    interface: &mut DesiredInterface,
    name: &str,
    direction: Direction,
    (rate, burst): (u64, u64),
    treatment: (Action, Option<&str>),
) -> Result<()> {
    interface.directions.push(direction);
    interface
        .classes
        .push(class(name, direction, rate, burst, treatment)?);
    Ok(())
}

/// What the configuration asks for on the host veth `dev` and, for `egressAction:
/// "shape"`, on the container's interface; None when it limits nothing.
pub fn desired(
    conf: &NetConf,
    dev: &str,
    container: Option<&Container>,
) -> Result<Option<Desired>> {
    let limits = conf.limits();
    let ingress = check_limit(limits.ingress_rate, limits.ingress_burst, "ingress")?;
    let egress = check_limit(limits.egress_rate, limits.egress_burst, "egress")?;
    let ingress_action = action(conf.ingress_action.as_deref(), "ingressAction")?;
    let egress_action = action(conf.egress_action.as_deref(), "egressAction")?;
    let mut host = interface(None, dev);
    let mut interfaces = Vec::new();
    // Toward the container: the host veth's egress.
    if let Some((rate, burst)) = ingress {
        limit(
            &mut host,
            INGRESS_CLASS,
            Direction::Egress,
            (rate, burst),
            (ingress_action, conf.ingress_fair.as_deref()),
        )?;
    }
    // From the container. Shaped on the container's own interface's egress: a queue
    // there pushes back on the container's sockets (TCP small queues), and its processes
    // lack CAP_NET_ADMIN to undo it; the host veth's ingress can only police or mark.
    if let Some((rate, burst)) = egress {
        if egress_action == Action::Shape {
            let Some(container) = container else {
                bail!(cni_error(
                    ERR_INVALID_CONFIG,
                    "egressAction shape needs the container's namespace under /run/netns \
                     (CNI_NETNS): use egressAction drop or ecn"
                ));
            };
            let mut inside = interface(Some(container.netns.clone()), &container.ifname);
            limit(
                &mut inside,
                EGRESS_CLASS,
                Direction::Egress,
                (rate, burst),
                (Action::Shape, conf.egress_fair.as_deref()),
            )?;
            interfaces.push(inside);
        } else {
            limit(
                &mut host,
                EGRESS_CLASS,
                Direction::Ingress,
                (rate, burst),
                (egress_action, conf.egress_fair.as_deref()),
            )?;
        }
    }
    if !host.classes.is_empty() {
        interfaces.insert(0, host);
    }
    if interfaces.is_empty() {
        return Ok(None);
    }
    Ok(Some(Desired {
        coordination: None,
        interfaces,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::CniError;

    fn conf(text: &str) -> NetConf {
        NetConf::parse(text.as_bytes()).unwrap()
    }

    #[test]
    fn runtime_config_wins_and_bits_become_bytes() {
        let c = conf(
            r#"{"cniVersion":"1.0.0","name":"n","type":"shaper-cni","ingressRate":1,"ingressBurst":1,
            "runtimeConfig":{"bandwidth":{"ingressRate":10000000,"ingressBurst":800000,"egressRate":2000000,"egressBurst":80}}}"#,
        );
        let wanted = desired(&c, "veth0", None).unwrap().unwrap();
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
                .and_then(|c| desired(&c, "v", None).map(|_| ()))
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
        assert!(desired(&c, "v", None).unwrap().is_none());
    }

    #[test]
    fn egress_shape_goes_inside_the_containers_namespace_or_is_refused() {
        let c = conf(
            r#"{"cniVersion":"1.0.0","name":"n","egressRate":5000000,"egressBurst":800000,
            "egressAction":"shape"}"#,
        );
        let container = Container {
            netns: "cni-1".into(),
            ifname: "eth0".into(),
        };
        let wanted = desired(&c, "veth0", Some(&container)).unwrap().unwrap();
        assert_eq!(wanted.interfaces.len(), 1, "no class on the host veth");
        let inside = &wanted.interfaces[0];
        assert_eq!(
            (inside.netns.as_deref(), inside.dev.as_str()),
            (Some("cni-1"), "eth0")
        );
        assert_eq!(inside.directions, vec![Direction::Egress]);
        assert_eq!(inside.classes[0].1.action.action, Action::Shape);
        let refused = desired(&c, "veth0", None).unwrap_err();
        assert_eq!(
            refused.downcast_ref::<CniError>().unwrap().code,
            ERR_INVALID_CONFIG
        );
        // Dropping stays on the host veth's ingress.
        let drop = conf(r#"{"cniVersion":"1.0.0","egressRate":5000000,"egressBurst":800000}"#);
        let wanted = desired(&drop, "veth0", Some(&container)).unwrap().unwrap();
        assert_eq!(wanted.interfaces[0].netns, None);
        assert_eq!(wanted.interfaces[0].directions, vec![Direction::Ingress]);
        assert_eq!(
            wanted.interfaces[0].classes[0].1.action.action,
            Action::Drop
        );
    }

    #[test]
    fn egress_actions_other_than_shape_stay_on_the_host_veth_as_asked() {
        let container = Container {
            netns: "cni-1".into(),
            ifname: "eth0".into(),
        };
        for (text, action) in [("ecn", Action::Ecn), ("drop", Action::Drop)] {
            let c = conf(&format!(
                r#"{{"cniVersion":"1.0.0","egressRate":5000000,"egressBurst":800000,
                "egressAction":"{text}"}}"#
            ));
            let wanted = desired(&c, "veth0", Some(&container)).unwrap().unwrap();
            let host = &wanted.interfaces[0];
            assert_eq!((host.netns.as_deref(), host.dev.as_str()), (None, "veth0"));
            assert_eq!(host.directions, vec![Direction::Ingress]);
            assert_eq!(
                host.classes[0].1.action.action, action,
                "egressAction {text}"
            );
        }
    }

    #[test]
    fn shaped_directions_share_fairly_as_asked() {
        use crate::classes::Fair;
        let container = Container {
            netns: "cni-1".into(),
            ifname: "eth0".into(),
        };
        let fair_of = |text: &str| -> Vec<Option<Fair>> {
            let wanted = desired(&conf(text), "veth0", Some(&container))
                .unwrap()
                .unwrap();
            wanted
                .interfaces
                .iter()
                .flat_map(|i| i.classes.iter().map(|(_, spec)| spec.codel.map(|c| c.fair)))
                .collect()
        };
        // Shaped both ways: fair by flow by default; each direction as asked.
        let both = r#"{"cniVersion":"1.0.0","ingressRate":5000000,"ingressBurst":800000,
            "egressRate":5000000,"egressBurst":800000,"ingressAction":"shape","egressAction":"shape""#;
        assert_eq!(
            fair_of(&format!("{both}}}")),
            vec![Some(Fair::Flow), Some(Fair::Flow)]
        );
        assert_eq!(
            fair_of(&format!(
                r#"{both},"ingressFair":"src","egressFair":"dst"}}"#
            )),
            vec![Some(Fair::Src), Some(Fair::Dst)]
        );
        // A value outside the list, or fairness asked of a policed direction: refused.
        for bad in [
            format!(r#"{both},"egressFair":"host"}}"#),
            r#"{"cniVersion":"1.0.0","egressRate":5000000,"egressBurst":800000,"egressFair":"dst"}"#
                .to_string(),
        ] {
            let refused = desired(&conf(&bad), "veth0", Some(&container)).unwrap_err();
            assert_eq!(
                refused.downcast_ref::<CniError>().unwrap().code,
                ERR_INVALID_CONFIG,
                "{bad}"
            );
        }
    }
}
