//! Declarative configuration: a TOML file describing interfaces and their classes, the
//! plan that makes the kernel match it (add / change / replace / delete, only what
//! differs), and the export of the current state in the same format.
//!
//! ```toml
//! [[interface]]
//! dev = "eth0"
//! netns = "blue"          # optional: a named network namespace (ip netns)
//! direction = "both"      # egress (default), ingress or both: where shaper attaches
//! flow_table_size = 65536 # optional, as attach --flow-table-size
//! split_aggregates = true # optional, ingress: as attach --split-aggregates
//!
//! [[interface.class]]
//! name = "voip"
//! direction = "egress"    # default egress
//! rate = "10mbit"
//! proto = "udp"
//! dport = "5060-5080"
//! action = "dscp=ef"      # every `class add` option, spelled as the CLI spells it
//! ```
//!
//! A file is checked completely before anything changes: every problem comes back with
//! the file, line and field it is about. The file is authoritative for the interfaces it
//! names (classes not in it are deleted there); other interfaces are left alone unless
//! the caller prunes them.
//!
//! One file a stage: [`schema`] (read and written), [`parse`](mod@parse) (checks, with
//! line numbers), [`plan`](mod@plan), [`execute`](mod@execute), [`export`](mod@export).

mod coordination;
mod execute;
mod export;
mod parse;
mod plan;
mod schema;

pub use coordination::Coordination;
pub use execute::{execute, execute_naming_the_failure, Failed};
pub use export::export;
pub use parse::{parse, Desired, DesiredInterface, Problem, Problems};
pub use plan::{plan, Plan, Prune, Step};

/// A small file with CLI defaults left out, for the unit tests.
#[cfg(test)]
const TEST_FILE: &str = r#"
[[interface]]
dev = "eth0"
direction = "both"

[[interface.class]]
name = "voip"
rate = "10mbit"
proto = "udp"
dport = 5060
action = "dscp=ef"

[[interface.class]]
name = "in"
direction = "ingress"
rate = 1000000
per = "src"
"#;
