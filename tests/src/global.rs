//! The lab for global classes: hosts, each a namespace with its own attachment and its
//! own `shaper daemon` (own config, own metrics port), one sink namespace they all send
//! to, and a real redis-server on loopback that the daemons agree through.
//!
//! ```text
//!  [pod i ns]                        host i ns                         sink ns
//!  [p0 198.18.(40+i).2 ─── v0 198.18.(40+i).1]  h0 198.18.(20+i).2/24 ─── s<i> 198.18.(20+i).1/24
//! ```
//! With pods ([`GlobalClass::pods`]), each host forwards a pod's traffic to the sink, as a
//! node forwards its containers' (the TCP test sends from the pods).
//! Each host's class on `h0` egress is the global class (`global = KEY`, rate = the
//! limit); what each host gets through is read at the sink (`s<i>` rx bytes) in 500 ms
//! windows. Daemons run in the host's namespace as root sees it (the file names the
//! namespace), so they reach Redis on loopback. Everything is removed on drop.

use crate::{
    cleanup::{remove_namespace, sweep_stale},
    process::{
        dies_with_parent, output_bounded, shaper_bin, wait_bounded, wait_listening, Transport,
    },
    proxy::Proxy,
    redis::{free_port, RedisServer, Role},
    redis_cluster::RedisCluster,
    sentinel::{Sentinel, SERVICE},
    topology::{new_lab_id, Netns},
};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{
    os::unix::fs::PermissionsExt as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

/// The window the targets take medians over.
pub const WINDOW: Duration = Duration::from_millis(500);
/// The host's device (in its namespace).
pub const HOST_DEV: &str = "h0";

/// A host's address, and the sink's address on the host's link.
pub fn host_addr(index: usize) -> String {
    format!("198.18.{}.2", 20 + index)
}

pub fn sink_addr(index: usize) -> String {
    format!("198.18.{}.1", 20 + index)
}

/// The address of the pod behind host `index`.
pub fn pod_addr(index: usize) -> String {
    format!("198.18.{}.2", 40 + index)
}

/// Host `index`'s Redis password.
fn host_password(index: usize) -> String {
    format!("pw-{index}-{}", std::process::id())
}

/// The lab allocator's Redis user and password.
const ALLOCATOR_USER: &str = "allocator";

fn allocator_password() -> String {
    format!("pw-allocator-{}", std::process::id())
}

/// One daemon process with its file and log.
struct DaemonProcess {
    child: Child,
    metrics_port: u16,
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = wait_bounded(&mut self.child, Duration::from_secs(5));
    }
}

/// What a global class looks like in every host's file.
#[derive(Clone, Debug)]
pub struct GlobalClass {
    pub limit: &'static str,
    pub action: &'static str,
    pub on_loss: &'static str,
    /// `on_coordinator_loss` per host (host i takes entry i), where hosts differ; empty:
    /// every host takes `on_loss`.
    pub on_loss_by_host: &'static [&'static str],
    pub interval: &'static str,
    /// A pod namespace behind each host, whose traffic the host forwards.
    pub pods: bool,
    /// `false`: each host's class is a plain class of `limit` (a static split, for the
    /// bench's side-by-side row), with no `global` key.
    pub global: bool,
    /// The daemons reach Redis by `rediss://` (TLS, a private CA: see [`GlobalLab::trust`]).
    pub tls: bool,
    /// Every host's daemon reports as `host-0`, with host 0's Redis user (hosts cloned
    /// with one id and one file).
    pub one_host_id: bool,
    /// Redis is a primary with a replica, watched by three sentinels, and the daemons
    /// reach it by `redis+sentinel://`.
    pub sentinel: bool,
    /// The daemons reach Redis through [`GlobalLab::proxy`] (a delay, a black hole).
    pub proxy: bool,
    /// Redis is a Redis Cluster of three primaries and their replicas
    /// ([`GlobalLab::cluster`]), reached by `redis+cluster://` (with [`GlobalClass::tls`],
    /// `rediss+cluster://`, the cluster's bus over TLS too).
    pub cluster: bool,
    /// Global classes on each host: `tenant` (the lab's key), then `tenant-1` ... (keys
    /// `KEY-1` ...), all matching every packet (`tenant` ranks first).
    pub classes: usize,
    /// Hosts that trust each other: each host's Redis user may run the fill too, and the
    /// daemons fill (`allocate = auto`); no allocator of its own. Else each host's user
    /// has a host's ACL alone and `shaper global allocate` fills, as its own user.
    pub hosts_allocate: bool,
}

impl Default for GlobalClass {
    fn default() -> Self {
        Self {
            limit: "30mbit",
            action: "drop",
            on_loss: "static",
            on_loss_by_host: &[],
            interval: "250ms",
            pods: false,
            global: true,
            tls: false,
            classes: 1,
            hosts_allocate: false,
            one_host_id: false,
            sentinel: false,
            proxy: false,
            cluster: false,
        }
    }
}

pub struct GlobalLab {
    pub hosts: Vec<Netns>,
    /// The pods behind the hosts (empty without [`GlobalClass::pods`]).
    pub pods: Vec<Netns>,
    pub sink: Netns,
    pub redis: RedisServer,
    /// With [`GlobalClass::sentinel`]: the replica and the sentinels.
    pub replica: Option<RedisServer>,
    pub sentinels: Vec<Sentinel>,
    /// With [`GlobalClass::cluster`]: the cluster the daemons use (`redis` is then idle).
    pub cluster: Option<RedisCluster>,
    /// With [`GlobalClass::proxy`]: the daemons' way to Redis.
    pub proxy: Option<Proxy>,
    /// With [`GlobalClass::sentinel`]: the first sentinel the hosts name, black-holed.
    sentinel_hole: Option<Proxy>,
    /// With [`GlobalClass::sentinel`]: a server the hosts' users may write (and, with
    /// TLS, with Redis's own certificate), and the sentinel that names it as the
    /// service's primary, listed second: a lying sentinel the others outvote.
    pub decoy: Option<(RedisServer, Sentinel)>,
    pub class: GlobalClass,
    /// The global key (unique per lab, so labs never share Redis state).
    pub key: String,
    daemons: Vec<Option<DaemonProcess>>,
    /// `shaper global allocate` (unless [`GlobalClass::hosts_allocate`]): its URL
    /// (without the password, which it reads from the environment), and its log.
    allocator: Option<DaemonProcess>,
    allocator_url: Option<String>,
    allocator_log: PathBuf,
    /// Each host's Redis URL: its own ACL user, limited to the script.
    urls: Vec<String>,
    /// Each host's `password_file` (the password is in the URL where there is none).
    password_files: Vec<Option<PathBuf>>,
    files: Vec<PathBuf>,
    logs: Vec<PathBuf>,
    senders: Vec<Option<Child>>,
    /// With TLS: the CA file daemons started from now on trust (`SSL_CERT_FILE`); at first
    /// the one that signed Redis's certificate.
    pub trust: Option<PathBuf>,
}

impl GlobalLab {
    pub fn new(hosts: usize, class: GlobalClass) -> Result<Self> {
        shaper_bin();
        sweep_stale();
        let id = new_lab_id();
        let mut lab = Self {
            hosts: (0..hosts)
                .map(|i| Netns {
                    name: format!("{id}-g{i}"),
                })
                .collect(),
            pods: (0..hosts)
                .filter(|_| class.pods)
                .map(|i| Netns {
                    name: format!("{id}-p{i}"),
                })
                .collect(),
            sink: Netns {
                name: format!("{id}-sink"),
            },
            redis: if class.tls && !class.cluster {
                RedisServer::start_tls()?
            } else {
                RedisServer::start()?
            },
            replica: None,
            sentinels: Vec::new(),
            cluster: match (class.cluster, class.proxy) {
                (true, true) => Some(RedisCluster::start_proxied(3)?),
                (true, false) => Some(RedisCluster::start(3, class.tls)?),
                (false, _) => None,
            },
            proxy: None,
            sentinel_hole: None,
            decoy: None,
            class,
            key: format!("lab-{id}"),
            daemons: Vec::new(),
            allocator: None,
            allocator_url: None,
            allocator_log: std::env::temp_dir().join(format!("{id}-allocator.log")),
            urls: Vec::new(),
            password_files: Vec::new(),
            files: Vec::new(),
            logs: Vec::new(),
            senders: (0..hosts).map(|_| None).collect(),
            trust: None,
        };
        lab.trust = match &lab.cluster {
            Some(cluster) => cluster.ca(),
            None => lab.redis.tls().map(|tls| tls.ca()),
        };
        lab.build().context("building the global lab failed")?;
        for index in 0..hosts {
            if lab.class.one_host_id && index > 0 {
                // A clone: the same file's user and password as host 0.
                let (url, file) = (lab.urls[0].clone(), lab.password_files[0].clone());
                lab.urls.push(url);
                lab.password_files.push(file);
                continue;
            }
            let password = host_password(index);
            let role = if lab.class.hosts_allocate {
                Role::Both
            } else {
                Role::Host { tenant: None }
            };
            let url = lab.user(&format!("host-{index}"), &password, role)?;
            // Even hosts read their password from a file only root may read; odd ones
            // keep it in the URL (both are documented).
            if index % 2 == 0 {
                let file = std::env::temp_dir().join(format!("{}.password", lab.hosts[index].name));
                std::fs::write(&file, format!("{password}\n"))?;
                std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))?;
                lab.urls.push(url.replace(&format!(":{password}@"), "@"));
                lab.password_files.push(Some(file));
            } else {
                lab.urls.push(url);
                lab.password_files.push(None);
            }
        }
        if lab.class.global && !lab.class.hosts_allocate {
            lab.user(ALLOCATOR_USER, &allocator_password(), Role::Allocator)?;
        }
        if lab.class.sentinel {
            lab.watch_with_sentinels()?;
        }
        if lab.class.proxy && lab.cluster.is_none() {
            let proxy = Proxy::start(lab.redis.port)?;
            let (direct, through) = (
                format!("127.0.0.1:{}/", lab.redis.port),
                format!("127.0.0.1:{}/", proxy.port),
            );
            for url in &mut lab.urls {
                *url = url.replace(&direct, &through);
            }
            lab.proxy = Some(proxy);
        }
        for index in 0..hosts {
            lab.start_daemon(index)?;
        }
        if lab.class.global && !lab.class.hosts_allocate {
            // Host 0's URL (its password is in its file) as the allocator's user.
            lab.allocator_url = Some(lab.urls[0].replace("host-0@", &format!("{ALLOCATOR_USER}@")));
            lab.start_allocator()?;
        }
        lab.wait_attached()?;
        Ok(lab)
    }

    /// Adds a Redis user of `role` where the daemons reach Redis (every node of a
    /// cluster); its URL.
    pub fn user(&mut self, user: &str, password: &str, role: Role) -> Result<String> {
        match &mut self.cluster {
            Some(cluster) => cluster.user(user, password, role),
            None => self.redis.user(user, password, role),
        }
    }

    /// With [`GlobalClass::proxy`]: every proxy between the daemons and Redis (one per
    /// node of a cluster).
    pub fn proxies(&self) -> Vec<&Proxy> {
        match &self.cluster {
            Some(cluster) => cluster.proxies.iter().collect(),
            None => self.proxy.iter().collect(),
        }
    }

    /// Redis killed: the lab's server, or every node of the cluster.
    pub fn kill_redis(&mut self) {
        match &mut self.cluster {
            Some(cluster) => cluster.kill(),
            None => self.redis.kill(),
        }
    }

    /// Redis started again empty (see [`RedisServer::restart_empty`] and
    /// [`RedisCluster::restart_empty`]).
    pub fn restart_redis_empty(&mut self, users_after: Duration) -> Result<()> {
        match &mut self.cluster {
            Some(cluster) => cluster.restart_empty(users_after),
            None => self.redis.restart_empty(users_after),
        }
    }

    /// With TLS: a CA that signed no certificate Redis shows.
    pub fn other_ca(&self) -> Option<PathBuf> {
        match &self.cluster {
            Some(cluster) => cluster.other_ca(),
            None => self.redis.tls().map(|tls| tls.other_ca()),
        }
    }

    /// The server that holds global key `key`'s state: the lab's Redis, or the primary of
    /// its slot in a cluster.
    pub fn redis_of(&self, key: &str) -> Result<&RedisServer> {
        match &self.cluster {
            Some(cluster) => {
                let shares = format!("shaper:{{{key}}}:shares");
                Ok(&cluster.nodes[cluster.primary_of(&shares)?])
            }
            None => Ok(&self.redis),
        }
    }

    /// A replica of the lab's Redis and three sentinels watching it; the hosts' URLs
    /// become `redis+sentinel://` ones naming the sentinels (`rediss+sentinel://` with
    /// TLS: the sentinels, the primary and the replica all speak it).
    fn watch_with_sentinels(&mut self) -> Result<()> {
        self.replica = Some(RedisServer::start_replica_of(&self.redis)?);
        let tls = self.redis.tls().is_some();
        let start = |server: &RedisServer| {
            if tls {
                Sentinel::start_tls(server)
            } else {
                Sentinel::start(server.port)
            }
        };
        for _ in 0..3 {
            self.sentinels.push(start(&self.redis)?);
        }
        let mut decoy = if tls {
            RedisServer::start_tls_like(&self.redis)?
        } else {
            RedisServer::start()?
        };
        for index in 0..self.hosts.len() {
            decoy.host_user(&format!("host-{index}"), &host_password(index))?;
        }
        if !self.class.hosts_allocate {
            decoy.user(ALLOCATOR_USER, &allocator_password(), Role::Allocator)?;
        }
        let liar = start(&decoy)?;
        self.decoy = Some((decoy, liar));
        // Ready for a failover once every sentinel knows the replica.
        let deadline = Instant::now() + Duration::from_secs(15);
        while !self
            .sentinels
            .iter()
            .all(|s| s.replicas().is_ok_and(|n| n == 1))
        {
            if Instant::now() > deadline {
                let replication = self.redis.cli(&["INFO", "replication"]).unwrap_or_default();
                bail!(
                    "the sentinels did not learn of the replica ({:?}); the primary: {replication}",
                    self.sentinels
                        .iter()
                        .map(|s| s.replicas())
                        .collect::<Vec<_>>()
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
        // The hosts name first a sentinel that never answers (a proxy that forwards
        // nothing, as a sentinel on a host that went down without a reset): lookups
        // must move on to the next one.
        let hole = Proxy::start(self.sentinels[0].port)?;
        hole.hold();
        let port_of = |sentinel: &Sentinel| sentinel.tls_port.unwrap_or(sentinel.port);
        let liar = self.decoy.as_ref().map(|(_, liar)| port_of(liar));
        let sentinels: Vec<String> = std::iter::once(hole.port)
            .chain(liar)
            .chain(self.sentinels.iter().map(port_of))
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        self.sentinel_hole = Some(hole);
        let primary_port = self.redis.tls().map_or(self.redis.port, |tls| tls.port);
        let primary = format!("127.0.0.1:{primary_port}/0");
        let watched = format!("{}/{SERVICE}/0", sentinels.join(","));
        for url in &mut self.urls {
            *url = url
                .replace("rediss://", "rediss+sentinel://")
                .replace("redis://", "redis+sentinel://")
                .replace(&primary, &watched);
        }
        Ok(())
    }

    fn build(&self) -> Result<()> {
        let ip = |args: &[&str]| -> Result<()> {
            let output = output_bounded(Command::new("ip").args(args), Duration::from_secs(10))?;
            if !output.status.success() {
                bail!(
                    "ip {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            Ok(())
        };
        ip(&["netns", "add", &self.sink.name])?;
        ip(&["-n", &self.sink.name, "link", "set", "lo", "up"])?;
        for (index, host) in self.hosts.iter().enumerate() {
            let sink_dev = format!("s{index}");
            ip(&["netns", "add", &host.name])?;
            ip(&["-n", &host.name, "link", "set", "lo", "up"])?;
            ip(&[
                "-n",
                &host.name,
                "link",
                "add",
                HOST_DEV,
                "type",
                "veth",
                "peer",
                "name",
                &sink_dev,
                "netns",
                &self.sink.name,
            ])?;
            let host_cidr = format!("{}/24", host_addr(index));
            let sink_cidr = format!("{}/24", sink_addr(index));
            ip(&["-n", &host.name, "addr", "add", &host_cidr, "dev", HOST_DEV])?;
            ip(&[
                "-n",
                &self.sink.name,
                "addr",
                "add",
                &sink_cidr,
                "dev",
                &sink_dev,
            ])?;
            ip(&["-n", &host.name, "link", "set", HOST_DEV, "up"])?;
            ip(&["-n", &self.sink.name, "link", "set", &sink_dev, "up"])?;
        }
        for (index, (pod, host)) in self.pods.iter().zip(&self.hosts).enumerate() {
            let pod_cidr = format!("{}/24", pod_addr(index));
            let gateway = format!("198.18.{}.1", 40 + index);
            let pod_net = format!("198.18.{}.0/24", 40 + index);
            ip(&["netns", "add", &pod.name])?;
            ip(&["-n", &pod.name, "link", "set", "lo", "up"])?;
            ip(&[
                "-n", &pod.name, "link", "add", "p0", "type", "veth", "peer", "name", "v0",
                "netns", &host.name,
            ])?;
            ip(&["-n", &pod.name, "addr", "add", &pod_cidr, "dev", "p0"])?;
            ip(&[
                "-n",
                &host.name,
                "addr",
                "add",
                &format!("{gateway}/24"),
                "dev",
                "v0",
            ])?;
            ip(&["-n", &pod.name, "link", "set", "p0", "up"])?;
            // The pods send wire-sized segments, not 64 KiB TSO aggregates: the shape
            // path cannot split an aggregate, and its cap drops one whole (see the
            // known limits in docs/DESIGN.md).
            let offloads = output_bounded(
                pod.command("ethtool")
                    .args(["-K", "p0", "tso", "off", "gso", "off"]),
                Duration::from_secs(10),
            )?;
            if !offloads.status.success() {
                bail!("cannot turn TSO/GSO off in {} (needs ethtool)", pod.name);
            }
            ip(&["-n", &host.name, "link", "set", "v0", "up"])?;
            ip(&[
                "-n",
                &pod.name,
                "route",
                "add",
                &format!("{}/32", sink_addr(index)),
                "via",
                &gateway,
            ])?;
            ip(&[
                "-n",
                &self.sink.name,
                "route",
                "add",
                &pod_net,
                "via",
                &host_addr(index),
            ])?;
            let forward = output_bounded(
                host.command("sysctl")
                    .args(["-qw", "net.ipv4.ip_forward=1"]),
                Duration::from_secs(10),
            )?;
            if !forward.status.success() {
                bail!("cannot turn forwarding on in {}", host.name);
            }
        }
        Ok(())
    }

    fn file_text(&self, index: usize) -> String {
        let class = &self.class;
        let global = if class.global {
            let on_loss = class.on_loss_by_host.get(index).unwrap_or(&class.on_loss);
            format!(
                "global = \"{}\"\non_coordinator_loss = \"{on_loss}\"\n",
                self.key
            )
        } else {
            String::new()
        };
        let password_file = match &self.password_files[index] {
            Some(file) => format!("password_file = \"{}\"\n", file.display()),
            None => String::new(),
        };
        let mut text = format!(
            "[coordination]\nredis = \"{}\"\n{password_file}host_id = \"host-{}\"\ninterval = \"{}\"\n\n\
             [[interface]]\ndev = \"{HOST_DEV}\"\nnetns = \"{}\"\n\n\
             [[interface.class]]\nname = \"tenant\"\nrate = \"{}\"\naction = \"{}\"\n{global}",
            self.urls[index],
            if class.one_host_id { 0 } else { index },
            class.interval,
            self.hosts[index].name,
            class.limit,
            class.action,
        );
        for more in 1..class.classes {
            text.push_str(&format!(
                "\n[[interface.class]]\nname = \"tenant-{more}\"\nrate = \"{}\"\naction = \"{}\"\n{}",
                class.limit,
                class.action,
                global.replace(&self.key, &format!("{}-{more}", self.key))
            ));
        }
        text
    }

    /// Starts (or starts again) host `index`'s daemon.
    pub fn start_daemon(&mut self, index: usize) -> Result<()> {
        let dir = std::env::temp_dir();
        let file = dir.join(format!("{}.toml", self.hosts[index].name));
        let log = dir.join(format!("{}.log", self.hosts[index].name));
        // Odd hosts keep their password in the URL: the file is the owner's alone, as
        // the package's /etc/shaper/shaper.toml (0640 root) is.
        std::fs::write(&file, self.file_text(index))?;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))?;
        let metrics_port = free_port()?;
        let mut command = Command::new(shaper_bin());
        // The daemons run outside the lab's namespaces: they die with this test process
        // even when it is killed before its drops run.
        dies_with_parent(&mut command);
        let child = command
            .args(["daemon", "-f"])
            .arg(&file)
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--interval", "1s"])
            .env(
                "RUST_LOG",
                std::env::var("SHAPER_LAB_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(self.trust.iter().map(|ca| ("SSL_CERT_FILE", ca)))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("cannot start shaper daemon")?;
        let process = DaemonProcess {
            child,
            metrics_port,
        };
        if index < self.daemons.len() {
            self.daemons[index] = Some(process);
        } else {
            self.daemons.push(Some(process));
            self.files.push(file);
            self.logs.push(log);
        }
        Ok(())
    }

    /// Starts (or starts again) the lab's allocator: `shaper global allocate` with host
    /// 0's file, as its own Redis user.
    pub fn start_allocator(&mut self) -> Result<()> {
        let url = self
            .allocator_url
            .clone()
            .context("this lab has no allocator")?;
        // The password in a file of the owner's alone (`--password-file`), none in the
        // environment: an allocator that ignored the option could not log in.
        let password_file = self.allocator_password_file();
        std::fs::write(&password_file, allocator_password())?;
        std::fs::set_permissions(
            &password_file,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )?;
        let mut command = Command::new(shaper_bin());
        dies_with_parent(&mut command);
        let child = command
            .args(["global", "allocate", "-f"])
            .arg(&self.files[0])
            .args(["--redis", &url])
            .arg("--password-file")
            .arg(&password_file)
            .env_remove("SHAPER_REDIS_PASSWORD")
            .env(
                "RUST_LOG",
                std::env::var("SHAPER_LAB_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(self.trust.iter().map(|ca| ("SSL_CERT_FILE", ca)))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&self.allocator_log)?)
            .spawn()
            .context("cannot start shaper global allocate")?;
        self.allocator = Some(DaemonProcess {
            child,
            metrics_port: 0,
        });
        Ok(())
    }

    /// Where the allocator's password is kept (removed with the lab).
    fn allocator_password_file(&self) -> PathBuf {
        self.allocator_log.with_extension("password")
    }

    /// The allocator's log so far.
    pub fn allocator_log(&self) -> String {
        std::fs::read_to_string(&self.allocator_log).unwrap_or_default()
    }

    /// SIGKILLs host `index`'s daemon (what the kernel holds stays).
    pub fn kill_daemon(&mut self, index: usize) {
        self.daemons[index] = None;
    }

    /// SIGTERMs host `index`'s daemon and waits for it to exit, as `systemctl stop` does
    /// (SIGKILL past 5 s).
    pub fn terminate_daemon(&mut self, index: usize) -> Result<()> {
        if let Some(daemon) = &mut self.daemons[index] {
            let pid = nix::unistd::Pid::from_raw(daemon.child.id() as i32);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
            wait_bounded(&mut daemon.child, Duration::from_secs(5))?;
        }
        self.daemons[index] = None;
        Ok(())
    }

    /// Every host's Redis password (from its URL or its password file).
    pub fn passwords(&self) -> Vec<String> {
        (0..self.hosts.len()).map(host_password).collect()
    }

    /// Lines of any daemon's log that show a Redis password (none should).
    pub fn password_leaks(&self) -> Vec<String> {
        let passwords = self.passwords();
        (0..self.daemons.len())
            .flat_map(|index| {
                self.daemon_log(index)
                    .lines()
                    .filter(|line| passwords.iter().any(|p| line.contains(p.as_str())))
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Host `index`'s configuration file.
    pub fn file(&self, index: usize) -> &std::path::Path {
        &self.files[index]
    }

    /// Host `index`'s `password_file`, if it has one.
    pub fn password_file(&self, index: usize) -> Option<&PathBuf> {
        self.password_files.get(index)?.as_ref()
    }

    /// Host `index`'s daemon: its pid and its metrics port, while it runs.
    pub fn daemon_process(&self, index: usize) -> Option<(u32, u16)> {
        let daemon = self.daemons.get(index)?.as_ref()?;
        Some((daemon.child.id(), daemon.metrics_port))
    }

    /// Every class on host `index`, as `shaper stats --json` shows them.
    pub fn class_rows(&self, index: usize) -> Result<Vec<Value>> {
        class_rows_in(&self.hosts[index].name)
    }

    pub fn daemon_log(&self, index: usize) -> String {
        std::fs::read_to_string(&self.logs[index]).unwrap_or_default()
    }

    fn wait_attached(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        for index in 0..self.hosts.len() {
            while self.class_row(index).is_err() {
                // The metrics port was free when picked, but another socket may take it
                // before the daemon binds it (a CI run lost one so): start it again on
                // another port.
                if self.daemon_log(index).contains("Address already in use") {
                    self.start_daemon(index)?;
                }
                if Instant::now() > deadline {
                    bail!(
                        "host {index}'s daemon did not attach its class; log:\n{}",
                        self.daemon_log(index)
                    );
                }
                thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }

    /// Waits (at most 10 s) until every host holds an equal part of the limit with all
    /// hosts counted, as idle hosts whose daemons ran a while do: the spare of a fill is
    /// spread evenly.
    pub fn wait_equal_parts(&self) -> Result<Vec<u64>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let count = self.hosts.len() as u64;
        loop {
            let rows: Vec<Value> = (0..self.hosts.len())
                .map(|index| self.class_row(index))
                .collect::<Result<_>>()?;
            let shares: Vec<u64> = rows
                .iter()
                .map(|row| row["share_bps"].as_u64().unwrap_or(0))
                .collect();
            let limits: Vec<u64> = rows
                .iter()
                .map(|row| row["rate_bps"].as_u64().context("a row without rate_bps"))
                .collect::<Result<_>>()?;
            let settled = rows
                .iter()
                .zip(&shares)
                .zip(&limits)
                .all(|((row, share), limit)| {
                    row["hosts"] == count && *share * count * 10 >= limit * 9
                });
            if settled {
                return Ok(shares);
            }
            if Instant::now() > deadline {
                bail!("the hosts did not settle on equal parts within 10 s: {shares:?}");
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Host `index`'s global class as `shaper stats --json` shows it.
    pub fn class_row(&self, index: usize) -> Result<Value> {
        class_row_in(&self.hosts[index].name)
    }

    /// Host `index`'s share now (bit/s), as installed in its maps.
    pub fn share(&self, index: usize) -> Result<u64> {
        self.class_row(index)?["share_bps"]
            .as_u64()
            .context("no share_bps")
    }

    /// Starts (or restarts at another rate) host `index`'s UDP sender toward the sink:
    /// iperf3 at `rate` for at most `seconds`, 1200-byte datagrams.
    pub fn send(&mut self, index: usize, rate: &str, seconds: u32) -> Result<()> {
        self.stop_sender(index)?;
        let port = 5400 + index as u16;
        // One server per host link, started once; iperf3 -s serves tests one after another.
        if !self.sink_server_running(port) {
            let mut server = self
                .sink
                .command("iperf3")
                .args(["-s", "-p", &port.to_string(), "-B", &sink_addr(index)])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            wait_listening(&self.sink, &mut server, Transport::Tcp, port)?;
            std::mem::forget(server); // killed with the sink namespace
        }
        let sender = self.hosts[index]
            .command("iperf3")
            .args(["-u", "-c", &sink_addr(index), "-p", &port.to_string()])
            .args(["-b", rate, "-l", "1200", "-t", &seconds.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        self.senders[index] = Some(sender);
        Ok(())
    }

    fn sink_server_running(&self, port: u16) -> bool {
        output_bounded(
            self.sink
                .command("ss")
                .args(["-Hltn", &format!("sport = :{port}")]),
            Duration::from_secs(5),
        )
        .is_ok_and(|out| !out.stdout.is_empty())
    }

    /// Stops host `index`'s sender; an error if it had already failed by itself.
    pub fn stop_sender(&mut self, index: usize) -> Result<()> {
        self.check_sender(index)?;
        if let Some(mut sender) = self.senders[index].take() {
            let _ = sender.kill();
            let _ = wait_bounded(&mut sender, Duration::from_secs(5));
        }
        Ok(())
    }

    /// An error when host `index`'s sender exited by itself with a failure (it could not
    /// reach the sink's server, say): its rates would read as the limiter's doing.
    fn check_sender(&mut self, index: usize) -> Result<()> {
        let Some(sender) = self.senders[index].as_mut() else {
            return Ok(());
        };
        match sender.try_wait()? {
            Some(status) if !status.success() => {
                let mut stderr = String::new();
                if let Some(mut pipe) = sender.stderr.take() {
                    use std::io::Read as _;
                    let _ = pipe.read_to_string(&mut stderr);
                }
                self.senders[index] = None;
                bail!(
                    "host {index}'s iperf3 sender failed ({status}): {}",
                    stderr.trim()
                )
            }
            _ => Ok(()),
        }
    }

    /// Bytes each host link has delivered to the sink so far (as on the wire).
    pub fn delivered(&self) -> Result<Vec<u64>> {
        let output = output_bounded(
            Command::new("ip").args(["-n", &self.sink.name, "-j", "-s", "link", "show"]),
            Duration::from_secs(5),
        )?;
        let links: Value = serde_json::from_slice(&output.stdout)?;
        (0..self.hosts.len())
            .map(|index| {
                let name = format!("s{index}");
                links
                    .as_array()
                    .and_then(|links| links.iter().find(|l| l["ifname"] == name.as_str()))
                    .and_then(|link| link["stats64"]["rx"]["bytes"].as_u64())
                    .with_context(|| format!("no rx bytes for {name}"))
            })
            .collect()
    }

    /// [`GlobalLab::delivered`] and when it was read: the middle of the `ip` call, which
    /// takes a few ms, or hundreds on a busy machine (a window timed at its end would
    /// then be short of bytes and the next one over).
    fn delivered_at(&self) -> Result<(Vec<u64>, Instant)> {
        let before = Instant::now();
        let bytes = self.delivered()?;
        Ok((bytes, before + before.elapsed() / 2))
    }

    /// Each host's delivered rate (bit/s, as on the wire) over consecutive windows of
    /// `WINDOW` for `duration`; `during` runs once per window (to act mid-run).
    pub fn windows(
        &mut self,
        duration: Duration,
        during: impl FnMut(&mut Self, usize) -> Result<()>,
    ) -> Result<Vec<Vec<f64>>> {
        self.windows_of(WINDOW, duration, during)
    }

    /// As [`GlobalLab::windows`], in windows of `window`.
    pub fn windows_of(
        &mut self,
        window: Duration,
        duration: Duration,
        mut during: impl FnMut(&mut Self, usize) -> Result<()>,
    ) -> Result<Vec<Vec<f64>>> {
        let count = (duration.as_millis() / window.as_millis()) as usize;
        let mut rates = Vec::with_capacity(count);
        let (mut last, mut at) = self.delivered_at()?;
        let mut next = at + window;
        for index in 0..count {
            during(self, index)?;
            for index in 0..self.senders.len() {
                self.check_sender(index)?;
            }
            let now = Instant::now();
            if next > now {
                thread::sleep(next - now);
            }
            let (bytes, now) = self.delivered_at()?;
            let seconds = (now - at).as_secs_f64();
            rates.push(
                bytes
                    .iter()
                    .zip(&last)
                    .map(|(after, before)| (after - before) as f64 * 8.0 / seconds)
                    .collect(),
            );
            last = bytes;
            at = now;
            next += window;
        }
        Ok(rates)
    }
}

impl GlobalLab {
    /// One TCP flow (the namespaces' default congestion control, Cubic) from every host
    /// (its pod, when it has one) to the sink at once for `seconds`: each client's iperf3
    /// JSON.
    pub fn tcp_all(&self, seconds: u32) -> Result<Vec<Value>> {
        let senders = if self.pods.is_empty() {
            &self.hosts
        } else {
            &self.pods
        };
        std::thread::scope(|scope| {
            let runs: Vec<_> = senders
                .iter()
                .enumerate()
                .map(|(index, host)| {
                    let sink = &self.sink;
                    scope.spawn(move || {
                        let args: Vec<String> =
                            ["-c", &sink_addr(index), "-t", &seconds.to_string()]
                                .iter()
                                .map(|arg| arg.to_string())
                                .collect();
                        crate::iperf::run(host, sink, 5500 + index as u16, &args, 1.0, seconds)
                    })
                })
                .collect();
            runs.into_iter()
                .map(|run| run.join().expect("an iperf3 thread panicked"))
                .collect()
        })
    }

    /// Host `index`'s daemon's /metrics.
    pub fn metrics(&self, index: usize) -> Result<String> {
        use std::io::{Read as _, Write as _};
        let daemon = self.daemons[index]
            .as_ref()
            .context("that daemon is stopped")?;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", daemon.metrics_port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    }
}

/// Every class on `h0` in namespace `netns`, as `shaper stats --json` shows them
/// (usable from another thread while the lab runs).
pub fn class_rows_in(netns: &str) -> Result<Vec<Value>> {
    let output = output_bounded(
        Command::new(shaper_bin()).args(["--netns", netns, "stats", "--json", "--dev", HOST_DEV]),
        Duration::from_secs(10),
    )?;
    if !output.status.success() {
        bail!("{}", String::from_utf8_lossy(&output.stderr));
    }
    let rows: Value = serde_json::from_slice(&output.stdout)?;
    Ok(rows.as_array().cloned().unwrap_or_default())
}

/// The global class `tenant` on `h0` in namespace `netns` (see [`class_rows_in`]).
pub fn class_row_in(netns: &str) -> Result<Value> {
    class_rows_in(netns)?
        .into_iter()
        .find(|row| row["name"] == "tenant")
        .context("no class tenant yet")
}

/// The median of `values`.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

impl Drop for GlobalLab {
    fn drop(&mut self) {
        for sender in self.senders.iter_mut().flatten() {
            let _ = sender.kill();
            let _ = wait_bounded(sender, Duration::from_secs(5));
        }
        self.daemons.clear();
        self.allocator = None;
        let _ = std::fs::remove_file(&self.allocator_log);
        let _ = std::fs::remove_file(self.allocator_password_file());
        for ns in self
            .pods
            .iter()
            .chain(&self.hosts)
            .chain(std::iter::once(&self.sink))
        {
            remove_namespace(&ns.name);
        }
        for path in self
            .files
            .iter()
            .chain(&self.logs)
            .chain(self.password_files.iter().flatten())
        {
            let _ = std::fs::remove_file(path);
        }
        // The daemons' instance records (`/run/shaper/global-HOST.instance`).
        for index in 0..self.hosts.len() {
            let _ = std::fs::remove_file(format!("/run/shaper/global-host-{index}.instance"));
        }
    }
}
