//! The file's schema: what `apply` and the daemon read (with spans, for line numbers)
//! and what `export` writes, side by side so the two stay one format.

use crate::class_input::ClassInput;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use toml::Spanned;

// ---- read

/// A TOML scalar given either as a string ("10mbit") or a number (53).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub(crate) enum Scalar {
    Number(i64),
    Switch(bool),
    Text(String),
}

impl Scalar {
    pub(super) fn text(&self) -> String {
        match self {
            Scalar::Number(n) => n.to_string(),
            Scalar::Switch(on) => on.to_string(),
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
    pub(super) password_file: Field<String>,
    pub(super) host_id: Field<String>,
    pub(super) interval: Field<String>,
    pub(super) allocate: Field<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct InterfaceEntry {
    pub(super) dev: Spanned<String>,
    pub(super) netns: Field<String>,
    pub(super) direction: Field<String>,
    pub(super) flow_table_size: Field<i64>,
    pub(super) attach_mode: Field<String>,
    pub(super) split_aggregates: Field<bool>,
    #[serde(default)]
    pub(super) class: Vec<ClassEntry>,
}

/// A class table: its fields by name (each with its place in the file), checked against
/// the one declaration of a class's fields (`class_input::FIELDS`) when the file is.
pub(super) type ClassEntry = Spanned<BTreeMap<Spanned<String>, Spanned<Scalar>>>;

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
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(super) split_aggregates: bool,
    pub(super) class: Vec<ClassInput>,
}
