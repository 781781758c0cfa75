//! Carrying out a plan.

use super::plan::{Plan, Step};
use crate::{
    classes, netns,
    state::{self, Attachment, Location},
};
use anyhow::Result;

/// Carries out a plan, in order; each step inside its namespace. Consecutive adds to one
/// attachment go in one batch.
pub fn execute(plan: &Plan) -> Result<()> {
    let mut index = 0;
    while index < plan.steps.len() {
        let step = &plan.steps[index];
        let netns_of = |location: &Location| location.netns.clone();
        match step {
            Step::Add(location, _) => {
                let mut specs = Vec::new();
                while let Some(Step::Add(next, spec)) = plan.steps.get(index) {
                    if next != location {
                        break;
                    }
                    specs.push(spec.clone());
                    index += 1;
                }
                netns::in_namespace(&netns_of(location), || {
                    classes::add_many(&Attachment::open(location)?, &specs).map(|_| ())
                })?;
                continue;
            }
            Step::Attach {
                location,
                flow_table_size,
                mode,
            } => {
                netns::in_namespace(&netns_of(location), || {
                    state::attach_fresh(location, *mode, *flow_table_size).map(|_| ())
                })?;
            }
            Step::Reattach(location) => {
                netns::in_namespace(&netns_of(location), || {
                    state::reattach(location).map(|_| ())
                })?;
            }
            Step::Detach(location) => {
                netns::in_namespace(&netns_of(location), || state::detach(location))?;
            }
            Step::Forget(location) => state::forget(location)?,
            Step::Change {
                location, wanted, ..
            } => {
                netns::in_namespace(&netns_of(location), || {
                    classes::change(&Attachment::open(location)?, wanted)
                })?;
            }
            Step::Replace(location, spec) => {
                netns::in_namespace(&netns_of(location), || {
                    classes::replace(&Attachment::open(location)?, spec)
                })?;
            }
            Step::Delete(location, name) => {
                netns::in_namespace(&netns_of(location), || {
                    classes::delete(&Attachment::open(location)?, name)
                })?;
            }
        }
        index += 1;
    }
    Ok(())
}
