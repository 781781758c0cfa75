//! Class names as stored in the maps (NUL-padded bytes).

use crate::error::usage;
use anyhow::Result;
use shaper_common::CLASS_NAME_LEN;

/// A class name as stored (NUL-padded); fails when too long.
pub(crate) fn encode_name(name: &str) -> Result<[u8; CLASS_NAME_LEN]> {
    let valid = !name.is_empty()
        && name.len() < CLASS_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c));
    if !valid {
        return Err(usage(format!(
            "bad class name '{name}': use 1-{} characters of letters, digits, '-', '_', '.', ':'",
            CLASS_NAME_LEN - 1
        )));
    }
    let mut out = [0u8; CLASS_NAME_LEN];
    out[..name.len()].copy_from_slice(name.as_bytes());
    Ok(out)
}

pub fn decode_name(raw: &[u8; CLASS_NAME_LEN]) -> String {
    let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).to_string()
}
