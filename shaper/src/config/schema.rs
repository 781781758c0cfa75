//! The file's schema: what `apply` and the daemon read (with spans, for line numbers)
//! and what `export` writes, side by side so the two stay one format.

use serde::{Deserialize, Serialize};
use toml::Spanned;

// ---- read

/// A TOML scalar given either as a string ("10mbit") or a number (53).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub(crate) enum Scalar {
    Number(i64),
    Text(String),
}

impl Scalar {
    pub(super) fn text(&self) -> String {
        match self {
            Scalar::Number(n) => n.to_string(),
            Scalar::Text(t) => t.clone(),
        }
    }
}

pub(super) type Field<T> = Option<Spanned<T>>;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct FileConfig {
    pub(super) coordination: Option<Spanned<CoordinationEntry>>,
    #[serde(default)]
    pub(super) interface: Vec<InterfaceEntry>,
}

/// `[coordination]`: the Redis that global classes agree on their shares through.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CoordinationEntry {
    pub(super) redis: Spanned<String>,
    pub(super) host_id: Field<String>,
    pub(super) interval: Field<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct InterfaceEntry {
    pub(super) dev: Spanned<String>,
    pub(super) netns: Field<String>,
    pub(super) direction: Field<String>,
    pub(super) flow_table_size: Field<i64>,
    pub(super) attach_mode: Field<String>,
    #[serde(default)]
    pub(super) class: Vec<ClassEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ClassEntry {
    pub(super) name: Spanned<String>,
    pub(super) direction: Field<String>,
    pub(super) rate: Spanned<Scalar>,
    pub(super) burst: Field<Scalar>,
    pub(super) per: Field<String>,
    pub(super) proto: Field<String>,
    pub(super) src: Field<String>,
    pub(super) dst: Field<String>,
    pub(super) sport: Field<Scalar>,
    pub(super) dport: Field<Scalar>,
    pub(super) prio: Field<i64>,
    pub(super) action: Field<String>,
    pub(super) excess_burst: Field<Scalar>,
    pub(super) peak_rate: Field<Scalar>,
    pub(super) peak_burst: Field<Scalar>,
    pub(super) exceed: Field<String>,
    pub(super) violate: Field<String>,
    pub(super) target: Field<String>,
    pub(super) interval: Field<String>,
    pub(super) ecn: Field<bool>,
    pub(super) parent: Field<String>,
    pub(super) ceil: Field<Scalar>,
    pub(super) cburst: Field<Scalar>,
    pub(super) global: Field<String>,
    pub(super) on_coordinator_loss: Field<String>,
    pub(super) floor: Field<Scalar>,
}

// ---- written

#[derive(Serialize)]
pub(super) struct ExportFile {
    pub(super) interface: Vec<ExportInterface>,
}

#[derive(Serialize)]
pub(super) struct ExportInterface {
    pub(super) dev: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) netns: Option<String>,
    pub(super) direction: String,
    pub(super) flow_table_size: u32,
    pub(super) attach_mode: String,
    pub(super) class: Vec<ExportClass>,
}

#[derive(Serialize)]
pub(super) struct ExportClass {
    pub(super) name: String,
    pub(super) direction: String,
    pub(super) rate: String,
    pub(super) burst: u64,
    pub(super) per: String,
    pub(super) prio: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) proto: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) src: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) dst: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) sport: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) dport: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) action: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) excess_burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) peak_rate: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) peak_burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) exceed: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) violate: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) target: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) interval: Option<String>,
    /// Written only when off (on is the default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) ecn: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) parent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) ceil: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) cburst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) global: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) on_coordinator_loss: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) floor: Option<String>,
}
