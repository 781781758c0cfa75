//! Builds the eBPF object (shaper-ebpf) with nightly and embeds it in the binary.
use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    // A build with the empty object must not outlive the variable: without this, a
    // `cargo build` after an `AYA_BUILD_SKIP=1 cargo test` kept the empty object.
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    // `cargo xtask test` lints with AYA_BUILD_SKIP=1: clippy needs the crate to compile,
    // not a real object, and clippy's own build directory would build one more (a minute).
    // aya-build then skips (and says so); an empty object stands in, which the loader
    // refuses with a clear error should such a build ever run.
    if std::env::var_os("AYA_BUILD_SKIP")
        .is_some_and(|skip| skip == "1" || skip.eq_ignore_ascii_case("true"))
    {
        let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR")?);
        std::fs::write(out_dir.join("shaper"), [])?;
    }
    let metadata_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shaper-ebpf");
    let root = metadata_dir
        .canonicalize()
        .context("shaper-ebpf directory is missing")?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "shaper-ebpf",
            root_dir: root.to_str().context("non-UTF-8 path")?,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
