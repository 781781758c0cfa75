//! Upgrades (issue 11, item 11): pins carry the layout version of the shaper that made
//! them, and a shaper of another layout refuses them with what to do, shows them in
//! `status`, and can still detach them, while the attached program keeps policing.

use anyhow::{ensure, Context as _, Result};
use aya::maps::{Array, Map, MapData};
use serde_json::Value;
use shaper_common::{map_names, LAYOUT_VERSION};
use shaper_tests::{assert_within, stderr, Lab, Netns, Udp, ROUTER_TO_SERVER};
use std::path::PathBuf;

/// The router's egress attachment's pin directory.
fn pin_dir(router: &Netns) -> PathBuf {
    PathBuf::from(format!(
        "/sys/fs/bpf/shaper/netns-{}/{ROUTER_TO_SERVER}/egress",
        router.name.replace('.', "%2E")
    ))
}

fn set_layout(router: &Netns, version: u32) -> Result<()> {
    let pin = pin_dir(router).join(map_names::LAYOUT);
    let data = MapData::from_pin(&pin).with_context(|| format!("open {}", pin.display()))?;
    let mut layout: Array<MapData, u32> = Array::try_from(Map::from_map_data(data)?)?;
    layout.set(0, version, 0)?;
    Ok(())
}

/// `class add` on the router: must fail with one line containing `expected`.
fn refused(router: &Netns, args: &[&str], expected: &str) -> Result<()> {
    let output = router.shaper_output(args);
    let message = stderr(&output);
    println!(
        "shaper {}: exit {:?}: {message}",
        args.join(" "),
        output.status.code()
    );
    ensure!(
        output.status.code() == Some(1),
        "exit {:?}",
        output.status.code()
    );
    ensure!(message.lines().count() == 1, "not one line: {message}");
    ensure!(message.contains(expected), "{message}");
    Ok(())
}

/// UDP at 10 Mbit/s towards the server for 3 s: the L2 rate delivered in the last 2 s.
fn udp_delivered(lab: &mut Lab) -> Result<f64> {
    let run = lab.udp(&Udp {
        length: 1200,
        ..Udp::at("10M", 3)
    })?;
    Ok(run.l2_bps_between(1.0, 3.0))
}

fn egress_row(router: &Netns) -> Result<Value> {
    let rows = router.shaper_json(&["status", "--json"])?;
    Ok(rows[0].clone())
}

#[test]
fn pins_of_another_layout_are_refused_shown_and_still_detach() -> Result<()> {
    let mut lab = Lab::new()?;
    let dev = ROUTER_TO_SERVER;
    lab.router.attach(dev, &[])?;
    lab.router
        .class_add("udp", dev, &["--rate", "1mbit", "--proto", "udp"])?;
    ensure!(egress_row(&lab.router)?["problem"].is_null());

    // A newer shaper's pins: every command that reads or writes them says so.
    set_layout(&lab.router, LAYOUT_VERSION + 1)?;
    let newer = format!(
        "attached by a newer shaper (state layout {}; this shaper reads layout {LAYOUT_VERSION})",
        LAYOUT_VERSION + 1
    );
    let add = [
        "class", "add", "x", "--dev", dev, "--rate", "2mbit", "--proto", "tcp",
    ];
    refused(&lab.router, &add, &newer)?;
    refused(&lab.router, &["class", "list"], &newer)?;
    refused(&lab.router, &["stats"], &newer)?;
    refused(&lab.router, &["export"], &newer)?;
    refused(&lab.router, &["attach", dev], &newer)?;
    // `status` shows it and succeeds; the program it cannot read still polices.
    let row = egress_row(&lab.router)?;
    println!("status: {row}");
    ensure!(
        row["live"] == false
            && row["problem"]
                == format!(
                    "state layout {}, this shaper reads {LAYOUT_VERSION}",
                    LAYOUT_VERSION + 1
                )
            && row["classes"].is_null(),
        "{row}"
    );
    let text = lab.router.shaper(&["status"])?;
    ensure!(text.contains("other shaper version"), "{text}");
    assert_within(
        "policed under a newer layout",
        udp_delivered(&mut lab)?,
        1e6,
        0.05,
    );

    // Pins from before the stamp (no LAYOUT map) are an older shaper's.
    std::fs::remove_file(pin_dir(&lab.router).join(map_names::LAYOUT))?;
    refused(
        &lab.router,
        &add,
        &format!("attached by an older shaper (state layout 0; this shaper reads layout {LAYOUT_VERSION}): keep its classes with the older binary's `shaper export`"),
    )?;

    // Detach works whatever the layout: the pins and the hook are gone.
    let detach = lab.router.shaper_output(&["detach", dev]);
    ensure!(detach.status.success(), "{}", stderr(&detach));
    ensure!(!pin_dir(&lab.router).exists());
    let rows = lab.router.shaper_json(&["status", "--json"])?;
    ensure!(
        rows.as_array().is_some_and(|rows| rows.is_empty()),
        "{rows}"
    );
    let unpoliced = udp_delivered(&mut lab)?;
    println!("after detach: {:.2} Mbit/s delivered", unpoliced / 1e6);
    ensure!(unpoliced > 5e6, "still policed after detach: {unpoliced}");

    // A fresh attach stamps this shaper's layout again.
    lab.router.attach(dev, &[])?;
    ensure!(egress_row(&lab.router)?["problem"].is_null());
    Ok(())
}
