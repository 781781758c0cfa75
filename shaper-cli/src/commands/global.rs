//! `shaper global publish`: a file's global limits into Redis (`shaper::global::publish`);
//! `shaper global allocate`: their fill, run until stopped (`shaper::global::allocate`).

use crate::cli::{AdminRedisArgs, AllocateArgs, GlobalCommand, PublishArgs};
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
        GlobalCommand::Allocate(args) => allocate(args),
    }
}

/// A file's global keys, and the Redis URL and password to reach them as another user
/// than the file's host (`--redis`, `--password-file` or $SHAPER_REDIS_PASSWORD).
struct Admin {
    keys: Vec<global::KeyLimits>,
    url: String,
    password: Option<String>,
}

fn admin(file: &str, args: &AdminRedisArgs) -> Result<Admin> {
    let redis = args.redis.as_deref();
    let password_file = args.password_file.as_deref();
    let desired = crate::config_file::load(file)?;
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
        return Err(usage(format!("{file} declares no global class")));
    }
    let coordination = desired.coordination.as_ref();
    let Some(url) = redis
        .map(str::to_string)
        .or_else(|| coordination.map(|c| c.redis.clone()))
    else {
        return Err(usage(format!(
            "{file} has no [coordination] redis: name the server with --redis"
        )));
    };
    global::check_url(&url).map_err(usage)?;
    if redis.is_some_and(global::url_has_password) {
        return Err(usage(format!(
            "--redis {} carries a password, which every user of this host can read (ps): put it in --password-file or ${PASSWORD_VARIABLE}",
            global::redacted(&url)
        )));
    }
    // The file's password_file belongs to the host's user; --redis names another user.
    let password_file = password_file.map(std::path::Path::to_path_buf).or_else(|| {
        redis
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
    Ok(Admin {
        keys,
        url,
        password,
    })
}

fn allocate(args: AllocateArgs) -> Result<()> {
    let admin = admin(&args.file, &args.admin)?;
    global::allocate(&admin.url, admin.password.as_deref(), &admin.keys)
        .map_err(|e| runtime(format!("{e:#}")))
}

fn publish(args: PublishArgs) -> Result<()> {
    let Admin {
        keys,
        url,
        password,
    } = admin(&args.file, &args.admin)?;
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
