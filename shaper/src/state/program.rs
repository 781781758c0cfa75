//! Loading one program of a loaded object: the kernel's verifier refusing it is said in
//! one line. Below the loader, the splitter and upgrade, which all load programs.

use crate::error::{one_line, runtime};
use anyhow::{Context as _, Result};
use aya::{programs::SchedClassifier, Ebpf};

/// Loads (verifies) one program of a loaded object.
pub fn load_program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut SchedClassifier> {
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()?;
    program.load().map_err(|e| {
        runtime(format!(
            "the kernel refused program {name}: {}",
            one_line(&format!("{e:#}"))
        ))
    })?;
    Ok(program)
}
