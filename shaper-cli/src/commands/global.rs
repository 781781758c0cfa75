//! `shaper global publish`: a file's global limits into Redis (`shaper::global::publish`).

use crate::cli::{GlobalCommand, PublishArgs};
use anyhow::Result;
use shaper::{
    error::{runtime, usage},
    global,
    units::format_rate,
};

/// The environment variable `global publish` reads an administrator's password from.
const PASSWORD_VARIABLE: &str = "SHAPER_REDIS_PASSWORD";

pub fn run(netns: Option<String>, command: GlobalCommand) -> Result<()> {
    if netns.is_some() {
        return Err(usage(
            "global limits live in Redis, not in a namespace: drop --netns",
        ));
    }
    match command {
        GlobalCommand::Publish(args) => publish(args),
    }
}

fn publish(args: PublishArgs) -> Result<()> {
    let desired = crate::config_file::load(&args.file)?;
    let interval = desired
        .coordination
        .as_ref()
        .map_or(global::DEFAULT_INTERVAL, |c| c.interval);
    let classes = desired.interfaces.iter().flat_map(|interface| {
        interface
            .classes
            .iter()
            .map(|(_, spec)| (interface.dev.as_str(), spec))
    });
    let keys = global::key_limits(classes, interval).map_err(|e| usage(format!("{e:#}")))?;
    if keys.is_empty() {
        return Err(usage(format!("{} declares no global class", args.file)));
    }
    let coordination = desired.coordination.as_ref();
    let Some(url) = args
        .redis
        .clone()
        .or_else(|| coordination.map(|c| c.redis.clone()))
    else {
        return Err(usage(format!(
            "{} has no [coordination] redis: name the server with --redis",
            args.file
        )));
    };
    global::check_url(&url).map_err(usage)?;
    if args.redis.as_deref().is_some_and(global::url_has_password) {
        return Err(usage(format!(
            "--redis {} carries a password, which every user of this host can read (ps): put it in --password-file or ${PASSWORD_VARIABLE}",
            global::redacted(&url)
        )));
    }
    let describe = |limits: &global::KeyLimits| {
        format!(
            "{}: limit {}, floor {}, interval {}",
            limits.key,
            format_rate(limits.limit_bits_per_sec),
            format_rate(limits.floor_bits_per_sec),
            humantime::format_duration(limits.interval)
        )
    };
    if args.dry_run {
        for limits in &keys {
            println!("would publish {}", describe(limits));
        }
        return Ok(());
    }
    // The file's password_file belongs to the host's user; --redis names another user.
    let password_file = args.password_file.clone().or_else(|| {
        args.redis
            .is_none()
            .then(|| coordination.and_then(|c| c.password_file.clone()))
            .flatten()
    });
    let password = match password_file {
        Some(path) => Some(global::read_password(&path).map_err(|e| usage(format!("{e:#}")))?),
        // An administrator's password from the environment (a secret store's injection),
        // never from argv: --password-file wins when both are given.
        None => std::env::var(PASSWORD_VARIABLE)
            .ok()
            .filter(|password| !password.is_empty()),
    };
    let published =
        global::publish(&url, password.as_deref(), &keys).map_err(|e| runtime(format!("{e:#}")))?;
    for key in published {
        let what = if key.changed {
            "published"
        } else {
            "unchanged"
        };
        println!("{what} {} (version {})", describe(&key.limits), key.version);
    }
    Ok(())
}
