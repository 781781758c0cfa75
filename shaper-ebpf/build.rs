//! Rebuild the eBPF object when the linker changes (a rebuilt bpf-linker, a new nightly).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
