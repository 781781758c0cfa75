//! Carrying out a plan, all or nothing: each step done records how to undo it, and a
//! step that fails undoes the steps before it, newest first, so the kernel is left as
//! the last good configuration made it.

use super::plan::{Plan, Step};
use crate::{
    classes::{self, ClassSpec},
    error::one_line,
    netns,
    state::{self, Attachment, Location},
};
use anyhow::Result;

/// How to take one done step back.
enum Undo {
    /// Classes a batch added.
    Delete(Location, Vec<String>),
    /// A class as it was before a change, a replace or a delete.
    Restore(Location, Box<ClassSpec>, Restore),
    Detach(Location),
    Resize(Location, u32),
    SwitchMode(Location, state::AttachMode),
    /// Splitting aggregates as it was.
    Split(Location, bool),
    /// A step that is not undone (a detach, forgotten pins): named in the error.
    Kept(String),
}

#[derive(Clone, Copy)]
enum Restore {
    /// Changed in place: changed back (bucket and counters kept).
    Change,
    /// Replaced: the old rule put back the same way.
    Replace,
    /// Deleted: added again (its counters start afresh).
    Add,
}

/// A plan that failed: the step it failed at, as the plan prints it (none when it failed
/// before any step), and the error.
pub struct Failed {
    pub step: Option<String>,
    pub error: anyhow::Error,
}

impl Failed {
    /// A failure outside the plan's steps (planning, the state lock).
    pub fn unnamed(error: anyhow::Error) -> Self {
        Self { step: None, error }
    }
}

/// Carries out a plan, in order; each step inside its namespace. Consecutive adds to one
/// attachment go in one batch. On a failing step the steps done are undone, newest
/// first, and the step's error returned (with the steps that cannot be undone, detaches
/// and forgotten pins, named in it).
pub fn execute(plan: &Plan) -> Result<()> {
    execute_naming_the_failure(plan).map_err(|failed| failed.error)
}

/// [`execute`], naming the step that failed (a class of a batch of adds by itself).
pub fn execute_naming_the_failure(plan: &Plan) -> std::result::Result<(), Failed> {
    let mut done: Vec<Undo> = Vec::new();
    let mut index = 0;
    while index < plan.steps.len() {
        let (taken, result) = run_step(plan, index, &mut done);
        if let Err((step, error)) = result {
            let kept: Vec<String> = done
                .iter()
                .filter_map(|undo| match undo {
                    Undo::Kept(step) => Some(step.clone()),
                    _ => None,
                })
                .collect();
            let undone = done.len() - kept.len();
            let failures: Vec<String> = done
                .into_iter()
                .rev()
                .filter(|undo| !matches!(undo, Undo::Kept(_)))
                .filter_map(|undo| undo_step(undo).err())
                .map(|error| one_line(&format!("{error:#}")))
                .collect();
            let error = if kept.is_empty() {
                error
            } else {
                error.context(format!("not undone: {}", kept.join("; ")))
            };
            let step = Some(step);
            if failures.is_empty() {
                if undone > 0 {
                    log::debug!("rolled back {undone} step(s) of the failed plan");
                }
                return Err(Failed { step, error });
            }
            let error = error.context(format!("and rolling back failed: {}", failures.join("; ")));
            return Err(Failed { step, error });
        }
        index += taken;
    }
    Ok(())
}

/// A step's result, naming the step (as the plan prints it) when it failed.
type StepResult = std::result::Result<(), (String, anyhow::Error)>;

/// Runs the step at `index` (with the adds to one attachment after it); the steps it
/// took and its result. What it did is pushed on `done`, a failing batch's partial adds
/// included.
fn run_step(plan: &Plan, index: usize, done: &mut Vec<Undo>) -> (usize, StepResult) {
    let netns_of = |location: &Location| location.netns.clone();
    let in_ns = |location: &Location, f: &mut dyn FnMut() -> Result<()>| {
        netns::in_namespace(&netns_of(location), f)
    };
    let step = &plan.steps[index];
    let result = match step {
        Step::Add(location, _) => return add_batch(plan, index, location, done),
        Step::Attach {
            location,
            flow_table_size,
            mode,
        } => in_ns(location, &mut || {
            state::attach_fresh(location, *mode, *flow_table_size)?;
            done.push(Undo::Detach(location.clone()));
            Ok(())
        }),
        Step::Reattach(location) => in_ns(location, &mut || reattach(location)),
        Step::SwitchMode { location, from, to } => in_ns(location, &mut || {
            state::switch_mode(location, *to)?;
            done.push(Undo::SwitchMode(location.clone(), *from));
            Ok(())
        }),
        Step::Resize { location, from, to } => in_ns(location, &mut || {
            state::resize_flow_table(location, *to)?;
            done.push(Undo::Resize(location.clone(), *from));
            Ok(())
        }),
        Step::Split { location, on } => in_ns(location, &mut || {
            classes::set_split(&Attachment::open(location)?, *on)
                .map(|()| done.push(Undo::Split(location.clone(), !*on)))
        }),
        // Not undone (a pruned interface, a removed direction): named if a later step fails.
        Step::Detach(location) => in_ns(location, &mut || {
            state::detach(location)?;
            done.push(Undo::Kept(step.to_string()));
            Ok(())
        }),
        Step::Forget(location) => state::forget(location).map(|()| {
            done.push(Undo::Kept(step.to_string()));
        }),
        Step::Change {
            location, wanted, ..
        } => in_ns(location, &mut || {
            restoring(
                location,
                &wanted.name,
                Restore::Change,
                done,
                &|attachment| classes::change(attachment, wanted),
            )
        }),
        Step::Replace(location, spec) => in_ns(location, &mut || {
            restoring(
                location,
                &spec.name,
                Restore::Replace,
                done,
                &|attachment| classes::replace(attachment, spec),
            )
        }),
        // Not undone (the queues are where the classes always meant them to be): named
        // if a later step fails.
        Step::Requeue(location, _) => in_ns(location, &mut || {
            classes::requeue(&Attachment::open(location)?)?;
            done.push(Undo::Kept(step.to_string()));
            Ok(())
        }),
        Step::Delete(location, _) => return delete_batch(plan, index, location, done),
    };
    (1, result.map_err(|error| (step.to_string(), error)))
}

/// Runs `step` on class `name`, remembering the class as it was, so that a later step's
/// failure restores it (`how`).
fn restoring(
    location: &Location,
    name: &str,
    how: Restore,
    done: &mut Vec<Undo>,
    step: &dyn Fn(&Attachment) -> Result<()>,
) -> Result<()> {
    let attachment = Attachment::open(location)?;
    let before = current(&attachment, name)?;
    step(&attachment)?;
    done.push(Undo::Restore(location.clone(), Box::new(before), how));
    Ok(())
}

/// Hooks a re-created interface's pinned program again; its splitting and aggregate cap
/// follow the interface as it is now.
fn reattach(location: &Location) -> Result<()> {
    state::reattach(location)?;
    let attachment = Attachment::open(location)?;
    classes::refresh_split(&attachment)?;
    classes::requeue(&attachment)?;
    classes::shape_classes_changed(&attachment);
    Ok(())
}

/// The adds to `location` from `index` on, in one batch; the steps taken and the result.
fn add_batch(
    plan: &Plan,
    index: usize,
    location: &Location,
    done: &mut Vec<Undo>,
) -> (usize, StepResult) {
    let specs: Vec<ClassSpec> = plan.steps[index..]
        .iter()
        .map_while(|step| match step {
            Step::Add(next, spec) if next == location => Some(spec.clone()),
            _ => None,
        })
        .collect();
    // Recorded first: a batch that fails midway keeps the classes before the failing one.
    let names = specs.iter().map(|spec| spec.name.clone()).collect();
    done.push(Undo::Delete(location.clone(), names));
    // The class that failed: the first the attachment does not hold (those before it stay).
    let mut failed: Option<&ClassSpec> = None;
    let result = netns::in_namespace(&location.netns.clone(), || {
        let attachment = Attachment::open(location)?;
        classes::add_many(&attachment, &specs)
            .map(|_| ())
            .inspect_err(|_| {
                failed = specs
                    .iter()
                    .find(|spec| !matches!(classes::find(&attachment, &spec.name), Ok(Some(_))));
            })
    });
    let result = result.map_err(|error| {
        let spec = failed.unwrap_or(&specs[0]).clone();
        (Step::Add(location.clone(), spec).to_string(), error)
    });
    (specs.len(), result)
}

/// The deletes from `location` from `index` on, in one batch (each delete alone reads
/// every class); the steps taken and the result. Each class deleted is recorded to be
/// added again if a later step fails.
fn delete_batch(
    plan: &Plan,
    index: usize,
    location: &Location,
    done: &mut Vec<Undo>,
) -> (usize, StepResult) {
    let names: Vec<String> = plan.steps[index..]
        .iter()
        .map_while(|step| match step {
            Step::Delete(next, name) if next == location => Some(name.clone()),
            _ => None,
        })
        .collect();
    let result = netns::in_namespace(&location.netns.clone(), || {
        let attachment = Attachment::open(location)?;
        let before = names
            .iter()
            .map(|name| current(&attachment, name))
            .collect::<Result<Vec<ClassSpec>>>()?;
        let deleted = classes::delete_many(&attachment, &names);
        // What went, whether or not all did, is put back if this or a later step fails.
        for spec in before {
            if deleted.is_ok() || classes::find(&attachment, &spec.name)?.is_none() {
                done.push(Undo::Restore(
                    location.clone(),
                    Box::new(spec),
                    Restore::Add,
                ));
            }
        }
        deleted
    });
    let result = result.map_err(|error| {
        let step = Step::Delete(location.clone(), names[0].clone());
        (step.to_string(), error)
    });
    (names.len(), result)
}

/// The class `name` as the attachment holds it now.
fn current(attachment: &Attachment, name: &str) -> Result<ClassSpec> {
    classes::read_class(attachment, name)?
        .map(|(_, spec)| spec)
        .ok_or_else(|| anyhow::anyhow!("class {name} is gone"))
}

fn undo_step(undo: Undo) -> Result<()> {
    let location = match &undo {
        Undo::Delete(location, _)
        | Undo::Restore(location, ..)
        | Undo::Detach(location)
        | Undo::Resize(location, _)
        | Undo::SwitchMode(location, _)
        | Undo::Split(location, _) => location.clone(),
        Undo::Kept(_) => return Ok(()),
    };
    netns::in_namespace(&location.netns.clone(), || match &undo {
        Undo::Delete(location, names) => {
            let attachment = Attachment::open(location)?;
            // Newest first: a child added after its parent goes before it. Together: each
            // delete alone reads every class.
            let mut present = Vec::new();
            for name in names.iter().rev() {
                if classes::find(&attachment, name)?.is_some() {
                    present.push(name.clone());
                }
            }
            classes::delete_many(&attachment, &present)
        }
        Undo::Restore(location, before, how) => {
            let attachment = Attachment::open(location)?;
            match how {
                Restore::Change => classes::change(&attachment, before),
                Restore::Replace => classes::replace(&attachment, before),
                Restore::Add => classes::add(&attachment, before).map(|_| ()),
            }
        }
        Undo::Detach(location) => state::detach(location),
        Undo::Resize(location, size) => state::resize_flow_table(location, *size).map(|_| ()),
        Undo::SwitchMode(location, mode) => state::switch_mode(location, *mode),
        Undo::Split(location, on) => classes::set_split(&Attachment::open(location)?, *on),
        Undo::Kept(_) => Ok(()),
    })
}

impl Step {
    /// Where the step acts.
    pub fn location(&self) -> &Location {
        match self {
            Step::Attach { location, .. }
            | Step::Reattach(location)
            | Step::SwitchMode { location, .. }
            | Step::Resize { location, .. }
            | Step::Split { location, .. }
            | Step::Detach(location)
            | Step::Forget(location)
            | Step::Add(location, _)
            | Step::Change { location, .. }
            | Step::Replace(location, _)
            | Step::Requeue(location, _)
            | Step::Delete(location, _) => location,
        }
    }

    /// The class a step adds, changes or replaces.
    fn class(&self) -> Option<&ClassSpec> {
        match self {
            Step::Add(_, spec) | Step::Replace(_, spec) | Step::Change { wanted: spec, .. } => {
                Some(spec)
            }
            _ => None,
        }
    }

    /// Whether `later`, a step after this one in a plan, may need this one done first:
    /// its interface attached or reconfigured, its parent class made, or (for an add)
    /// a class deleted that frees a name or a slot.
    fn may_prepare(&self, later: &Step) -> bool {
        if self.location() != later.location() {
            return false;
        }
        let parent = later
            .class()
            .and_then(|spec| spec.tree.as_ref())
            .map(|tree| tree.parent.as_str());
        match self {
            Step::Delete(..) => matches!(later, Step::Add(..)),
            Step::Add(..) | Step::Change { .. } | Step::Replace(..) => {
                parent.is_some_and(|parent| self.class().is_some_and(|c| c.name == parent))
            }
            Step::Detach(_) | Step::Forget(_) => false,
            _ => true,
        }
    }
}

impl Plan {
    /// Moves the step `failed` names (as the plan prints it) to the front, so that a
    /// retry of a plan that failed there fails again before changing anything; false
    /// (the order kept) when the plan has no such step or a step before it may be one
    /// it needs ([`Step::may_prepare`]).
    pub fn failed_step_first(&mut self, failed: &str) -> bool {
        let Some(index) = self
            .steps
            .iter()
            .position(|step| step.to_string() == failed)
        else {
            return false;
        };
        let step = &self.steps[index];
        if self.steps[..index]
            .iter()
            .any(|before| before.may_prepare(step))
        {
            return false;
        }
        let step = self.steps.remove(index);
        self.steps.insert(0, step);
        true
    }
}
