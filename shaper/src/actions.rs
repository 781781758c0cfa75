//! What a class does to packets over its rate: `--action`.

use shaper_common::Action;
use std::{fmt, str::FromStr};

/// An action with its parameter, as stored in the class config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActionSpec {
    pub action: Action,
    /// DSCP value, or fwmark value.
    pub arg: u32,
    /// fwmark mask (bits of skb->mark the action sets).
    pub mask: u32,
}

impl ActionSpec {
    /// The default over-rate action: police.
    pub const DROP: Self = Self::plain(Action::Drop);
    /// A meter's default for yellow packets: let them through.
    pub const PASS: Self = Self::plain(Action::Pass);

    /// An action without a parameter.
    pub const fn plain(action: Action) -> Self {
        Self {
            action,
            arg: 0,
            mask: 0,
        }
    }
}

impl Default for ActionSpec {
    fn default() -> Self {
        Self::DROP
    }
}

const DSCP_NAMES: &[(&str, u32)] = &[
    ("be", 0),
    ("cs0", 0),
    ("cs1", 8),
    ("af11", 10),
    ("af12", 12),
    ("af13", 14),
    ("cs2", 16),
    ("af21", 18),
    ("af22", 20),
    ("af23", 22),
    ("cs3", 24),
    ("af31", 26),
    ("af32", 28),
    ("af33", 30),
    ("cs4", 32),
    ("af41", 34),
    ("af42", 36),
    ("af43", 38),
    ("cs5", 40),
    ("ef", 46),
    ("cs6", 48),
    ("cs7", 56),
];

/// Parses a DSCP as a number 0-63 or a name (af11…af43, cs0…cs7, ef, be).
pub(crate) fn parse_dscp(text: &str) -> Result<u32, String> {
    let lower = text.to_ascii_lowercase();
    if let Some((_, value)) = DSCP_NAMES.iter().find(|(name, _)| *name == lower) {
        return Ok(*value);
    }
    match parse_number(&lower) {
        Some(value) if value < 64 => Ok(value),
        _ => Err(format!(
            "bad DSCP '{text}' (expected 0-63, af11…af43, cs0…cs7, ef or be)"
        )),
    }
}

fn parse_number(text: &str) -> Option<u32> {
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

impl FromStr for ActionSpec {
    type Err = String;

    /// Parses `drop`, `ecn`, `pass`, `shape`, `dscp=VALUE` or `fwmark=N[/MASK]`.
    fn from_str(text: &str) -> Result<Self, String> {
        let (name, value) = match text.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (text, None),
        };
        let action = Action::from_name(&name.to_ascii_lowercase()).ok_or_else(|| {
            format!(
                "unknown action '{text}' (expected drop, ecn, dscp=VALUE, fwmark=N[/MASK], pass or shape)"
            )
        })?;
        match (action, value) {
            (Action::Dscp, Some(value)) => Ok(Self {
                action,
                arg: parse_dscp(value)?,
                mask: 0,
            }),
            (Action::Dscp, None) => Err("dscp needs a value: dscp=VALUE".into()),
            (Action::Fwmark, Some(value)) => parse_fwmark(value),
            (Action::Fwmark, None) => Err("fwmark needs a value: fwmark=N[/MASK]".into()),
            (_, None) => Ok(Self::plain(action)),
            (_, Some(_)) => Err(format!("action '{name}' takes no value")),
        }
    }
}

/// `N[/MASK]`, decimal or 0x hex; the mark may not set bits outside the mask.
fn parse_fwmark(value: &str) -> Result<ActionSpec, String> {
    let (mark, mask) = match value.split_once('/') {
        Some((mark, mask)) => (mark, Some(mask)),
        None => (value, None),
    };
    let bad = || format!("bad fwmark '{value}' (expected N or N/MASK, decimal or 0x hex)");
    let mark = parse_number(mark).ok_or_else(bad)?;
    let mask = match mask {
        Some(mask) => parse_number(mask).ok_or_else(bad)?,
        None => u32::MAX,
    };
    if mark & !mask != 0 {
        return Err(format!(
            "fwmark {mark:#x} has bits outside its mask {mask:#x}"
        ));
    }
    Ok(ActionSpec {
        action: Action::Fwmark,
        arg: mark,
        mask,
    })
}

impl ActionSpec {
    pub(crate) fn from_config(action: u8, arg: u32, mask: u32) -> Self {
        Self {
            action: Action::try_from(action).unwrap_or(Action::Drop),
            arg,
            mask,
        }
    }
}

/// The spelling `from_str` accepts.
impl fmt::Display for ActionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.action {
            Action::Dscp => write!(f, "dscp={}", self.arg),
            Action::Fwmark if self.mask == u32::MAX => write!(f, "fwmark={:#x}", self.arg),
            Action::Fwmark => write!(f, "fwmark={:#x}/{:#x}", self.arg, self.mask),
            plain => f.write_str(plain.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_parse_and_print_back() {
        for text in [
            "drop",
            "ecn",
            "pass",
            "shape",
            "dscp=10",
            "fwmark=0x10",
            "fwmark=0x10/0xff",
        ] {
            assert_eq!(text.parse::<ActionSpec>().unwrap().to_string(), text);
        }
        assert_eq!(ActionSpec::from_str("dscp=af11").unwrap().arg, 10);
        assert_eq!(ActionSpec::from_str("dscp=EF").unwrap().arg, 46);
        assert_eq!(ActionSpec::from_str("dscp=cs7").unwrap().arg, 56);
        assert_eq!(ActionSpec::from_str("fwmark=16").unwrap().arg, 16);
        assert!(ActionSpec::from_str("dscp=64").is_err());
        assert!(ActionSpec::from_str("dscp=af44").is_err());
        assert!(ActionSpec::from_str("dscp").is_err());
        assert!(ActionSpec::from_str("fwmark=0x100/0xff").is_err());
        assert!(ActionSpec::from_str("fwmark=x").is_err());
        assert!(ActionSpec::from_str("drop=1").is_err());
        assert!(ActionSpec::from_str("reject").is_err());
    }
}
