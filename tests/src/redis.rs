//! A real redis-server for global classes: on a loopback port picked here, no persistence,
//! stopped on drop (also when a test panics) and killed with the test process (also when
//! that is killed outright). `restart_empty` is the "Redis restarted and
//! lost everything" case, with its ACL users made a moment later. With TLS
//! ([`RedisServer::start_tls`]) it also listens for `rediss://` on a second loopback port,
//! with a certificate from a private CA made here.

use crate::process::{dies_with_parent, output_bounded, run_checked, wait_bounded};
use crate::proxy::Proxy;
use anyhow::{bail, Context as _, Result};
use std::{
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

pub struct RedisServer {
    /// The plain port: redis-cli (ACLs, INFO) and `redis://` clients.
    pub port: u16,
    child: Option<Child>,
    /// ACL users made after every start (a restart loses them, as it loses the data).
    users: Vec<(String, String, Role)>,
    tls: Option<Tls>,
    /// The primary's port, for a replica.
    replica_of: Option<u16>,
    /// For a node of a Redis Cluster: where it keeps `nodes.conf`, its bus port, and how
    /// clients reach it.
    cluster: Option<ClusterNode>,
}

/// A Redis Cluster node's own settings.
struct ClusterNode {
    dir: PathBuf,
    /// Picked free, as the client port is: the default (the client port + 10000) is past
    /// 65535 for a fifth of the ports Linux hands out, and Redis then will not start.
    bus_port: u16,
    /// Reached through a proxy: the proxy's port, which the node gives clients as its own.
    announced_port: Option<u16>,
}

impl ClusterNode {
    /// The node listening on `port`, keeping `nodes.conf` in a directory of its own in `dir`.
    fn in_dir(dir: &Path, port: u16, bus_port: u16, announced_port: Option<u16>) -> Result<Self> {
        let dir = dir.join(port.to_string());
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            dir,
            bus_port,
            announced_port,
        })
    }
}

/// The TLS listener's port and files: `ca.pem` signed the server's certificate,
/// `other-ca.pem` signed nothing this server shows. Removed on drop.
pub struct Tls {
    pub port: u16,
    pub dir: PathBuf,
}

impl Tls {
    /// The CA that signed the server's certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A CA that did not.
    pub fn other_ca(&self) -> PathBuf {
        self.dir.join("other-ca.pem")
    }

    /// A new directory with this one's CAs, certificate and key (for another server
    /// the same clients trust); its port still to be chosen.
    pub fn copy_of(&self) -> Result<Self> {
        static COPIES: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "{REDIS_TLS_PREFIX}{}-copy{}",
            std::process::id(),
            COPIES.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let copy = Self {
            port: free_port()?,
            dir,
        };
        for name in ["ca.pem", "other-ca.pem", "server.pem", "server.key"] {
            std::fs::copy(self.dir.join(name), copy.dir.join(name))
                .with_context(|| format!("cannot copy {name}"))?;
        }
        Ok(copy)
    }

    /// A new directory of keys and certificates; its port still to be chosen.
    pub fn new() -> Result<Self> {
        static SERVERS: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "{REDIS_TLS_PREFIX}{}-{}",
            std::process::id(),
            SERVERS.fetch_add(1, Ordering::Relaxed)
        ));
        Self::make(&dir)?;
        Ok(Self { port: 0, dir })
    }

    fn make(dir: &Path) -> Result<()> {
        // Owner-only, and new: a directory left by another run is an error, not reused.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let openssl = |args: &[&str]| -> Result<()> {
            run_checked(Command::new("openssl").current_dir(dir).args(args))
                .context("openssl (Debian package openssl; `cargo xtask setup` installs it)")
                .map(|_| ())
        };
        for ca in ["ca", "other-ca"] {
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                &format!("/CN=shaper test {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
            ])?;
        }
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ])?;
        std::fs::write(dir.join("server.ext"), "subjectAltName = IP:127.0.0.1\n")?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "server.ext",
            "-out",
            "server.pem",
        ])
    }
}

impl Drop for Tls {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Who a Redis user of the lab is, and so its ACL (docs/GUIDE.md's, word for word).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// A host: its own report (`shaper:{*}:r:USER`) read and written, the last fill read,
    /// its name added to the announcements; nothing else. `tenant`: the keys' prefix
    /// (`shaper:{tenant-a-*}`), or every key.
    Host { tenant: Option<String> },
    /// An allocator: the fill script (and its load after NOSCRIPT) with the commands it
    /// calls (a script runs with its caller's rights), on the shares and announcements,
    /// reading the reports and the published limits.
    Allocator,
    /// Both: a host that runs the fill too (`allocate = auto`, hosts that trust each
    /// other).
    Both,
}

impl Role {
    /// The `ACL SETUSER` rules of `user` (after `reset on >PASSWORD`).
    pub fn acl(&self, user: &str) -> Vec<String> {
        let host = |glob: &str| {
            vec![
                format!("%RW~shaper:{{{glob}}}:r:{user}"),
                format!("%R~shaper:{{{glob}}}:shares"),
                "+get".into(),
                "+set".into(),
                "+hexists".into(),
                "+hmget".into(),
                "+time".into(),
                // A cluster's slots, for a cluster client (node addresses only).
                "+cluster|slots".into(),
                format!("(~shaper:{{{glob}}}:hosts +sadd)"),
            ]
        };
        let allocator = || {
            vec![
                "~shaper:{*}:shares".to_string(),
                "~shaper:{*}:hosts".into(),
                "%R~shaper:{*}:limits".into(),
                "%R~shaper:{*}:r:*".into(),
                "+evalsha".into(),
                "+script|load".into(),
                "+time".into(),
                "+get".into(),
                "+hget".into(),
                "+hset".into(),
                "+hkeys".into(),
                "+hgetall".into(),
                "+del".into(),
                "+unlink".into(),
                "+scard".into(),
                "+spop".into(),
                "+pexpire".into(),
                "+cluster|slots".into(),
            ]
        };
        let mut rules = vec![
            "resetkeys".to_string(),
            "resetchannels".into(),
            "-@all".into(),
        ];
        match self {
            Role::Host { tenant } => {
                let glob = tenant.as_ref().map_or("*".to_string(), |t| format!("{t}*"));
                rules.extend(host(&glob));
            }
            Role::Allocator => rules.extend(allocator()),
            Role::Both => {
                rules.extend(host("*"));
                rules.extend(allocator());
            }
        }
        rules
    }
}

/// A loopback port nothing listens on now.
pub fn free_port() -> Result<u16> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(socket.local_addr()?.port())
}

/// `N` distinct loopback ports nothing listens on now (all held while picking).
fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let sockets: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()?;
    let mut ports = [0; N];
    for (port, socket) in ports.iter_mut().zip(&sockets) {
        *port = socket.local_addr()?.port();
    }
    Ok(ports)
}

/// The temp directories of TLS servers: `{prefix}{pid}-{n}`, swept after a killed run.
pub const REDIS_TLS_PREFIX: &str = "shaper-redis-tls-";

impl RedisServer {
    /// Where a server outside a cluster keeps whatever it writes (see `spawn`).
    fn data_dir(&self) -> PathBuf {
        std::env::temp_dir().join(format!("shaper-redis-{}-{}", std::process::id(), self.port))
    }

    pub fn start() -> Result<Self> {
        Self::launch(free_port()?, None, None)
    }

    fn launch(port: u16, tls: Option<Tls>, cluster: Option<ClusterNode>) -> Result<Self> {
        let mut server = Self {
            port,
            child: None,
            users: Vec::new(),
            tls,
            replica_of: None,
            cluster,
        };
        server.spawn()?;
        Ok(server)
    }

    /// A Redis Cluster node (not yet joined: see `crate::redis_cluster`) keeping its
    /// `nodes.conf` in `dir`, which fails over within about a second of its primary's
    /// silence. With `tls` (a copy of another node's, see [`Tls::copy_of`]), it also
    /// listens for TLS, and the cluster's bus speaks TLS.
    pub fn start_cluster_node(dir: &Path, tls: Option<Tls>) -> Result<Self> {
        let [port, tls_port, bus_port] = free_ports()?;
        let tls = tls.map(|mut tls| {
            tls.port = tls_port;
            tls
        });
        let node = ClusterNode::in_dir(dir, port, bus_port, None)?;
        Self::launch(port, tls, Some(node))
    }

    /// A cluster node (plain, not yet joined) that clients reach only through a proxy of
    /// its own: the cluster names the proxy's port as the node's, so a cluster client
    /// follows slots and redirections through the proxies; the bus stays direct.
    pub fn start_proxied_cluster_node(dir: &Path) -> Result<(Self, Proxy)> {
        let [port, bus_port] = free_ports()?;
        let proxy = Proxy::start(port)?;
        let node = ClusterNode::in_dir(dir, port, bus_port, Some(proxy.port))?;
        Ok((Self::launch(port, None, Some(node))?, proxy))
    }

    /// A cluster node's bus port.
    pub fn bus_port(&self) -> Option<u16> {
        self.cluster.as_ref().map(|node| node.bus_port)
    }

    /// A replica of `primary` (for Sentinel to promote), with the primary's ACL users (ACL
    /// users are not replicated).
    pub fn start_replica_of(primary: &RedisServer) -> Result<Self> {
        // A TLS primary's replica listens for TLS too, with the same certificate, and
        // replicates over TLS (it then tells the primary, and so the sentinels, its TLS
        // port).
        let tls = primary.tls.as_ref().map(Tls::copy_of).transpose()?;
        let mut server = Self {
            port: free_port()?,
            child: None,
            users: Vec::new(),
            tls,
            replica_of: Some(primary.tls.as_ref().map_or(primary.port, |tls| tls.port)),
            cluster: None,
        };
        server.spawn()?;
        for (user, password, role) in &primary.users {
            server.user(user, password, role.clone())?;
        }
        Ok(server)
    }

    /// A TLS server with `other`'s certificate (a decoy the same clients would trust),
    /// its own data, and no users but the default one.
    pub fn start_tls_like(other: &RedisServer) -> Result<Self> {
        let mut tls = other.tls.as_ref().context("not a TLS server")?.copy_of()?;
        let [port, tls_port] = free_ports()?;
        tls.port = tls_port;
        Self::launch(port, Some(tls), None)
    }

    /// A server that also listens for TLS (clients not asked for certificates).
    pub fn start_tls() -> Result<Self> {
        let mut tls = Tls::new()?;
        // Ports picked after the keys (seconds on a busy machine), both at once.
        let [port, tls_port] = free_ports()?;
        tls.port = tls_port;
        Self::launch(port, Some(tls), None)
    }

    pub fn tls(&self) -> Option<&Tls> {
        self.tls.as_ref()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Adds a host's ACL user ([`Role::Host`] over every key; again after every
    /// restart); its URL (`rediss://` on the TLS port when the server has one).
    pub fn host_user(&mut self, user: &str, password: &str) -> Result<String> {
        self.user(user, password, Role::Host { tenant: None })
    }

    /// Adds an ACL user of `role` (again after every restart); its URL.
    pub fn user(&mut self, user: &str, password: &str, role: Role) -> Result<String> {
        self.make_user(user, password, &role)?;
        self.users
            .push((user.to_string(), password.to_string(), role));
        Ok(match &self.tls {
            Some(tls) => format!("rediss://{user}:{password}@127.0.0.1:{}/0", tls.port),
            None => format!("redis://{user}:{password}@127.0.0.1:{}/0", self.port),
        })
    }

    fn make_user(&self, user: &str, password: &str, role: &Role) -> Result<()> {
        let pass = format!(">{password}");
        let rules = role.acl(user);
        let mut args = vec!["ACL", "SETUSER", user, "reset", "on", &pass];
        args.extend(rules.iter().map(String::as_str));
        let reply = self.cli(&args)?;
        if reply.trim() != "OK" {
            bail!("ACL SETUSER {user}: {reply}");
        }
        Ok(())
    }

    fn spawn(&mut self) -> Result<()> {
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ]);
        if self.cluster.is_none() {
            // A replica writes what its primary sends into its working directory (a
            // dump.rdb, even with --save ""): a directory of its own, removed on drop,
            // never the caller's (the tests run in the source tree).
            let dir = self.data_dir();
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            command.arg("--dir").arg(&dir);
        }
        if let Some(primary) = self.replica_of {
            command.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
            if self.tls.is_some() {
                command.args(["--tls-replication", "yes"]);
            }
        }
        if let Some(node) = &self.cluster {
            command
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-port", &node.bus_port.to_string()])
                .arg("--dir")
                .arg(&node.dir);
            if let Some(announced) = node.announced_port {
                command.args(["--cluster-announce-port", &announced.to_string()]);
            }
            if self.tls.is_some() {
                // Replicas reach their primary at the port the cluster names: TLS's.
                command.args(["--tls-cluster", "yes", "--tls-replication", "yes"]);
            }
        }
        if let Some(tls) = &self.tls {
            let file = |name: &str| tls.dir.join(name).display().to_string();
            command
                .args(["--tls-port", &tls.port.to_string()])
                .args(["--tls-cert-file", &file("server.pem")])
                .args(["--tls-key-file", &file("server.key")])
                .args(["--tls-ca-cert-file", &file("ca.pem")])
                .args(["--tls-auth-clients", "no"])
                .args(["--logfile", &file("redis.log")]);
        }
        // Killed with the test process, even by SIGKILL: no server outlives its run.
        let child = dies_with_parent(&mut command)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start redis-server (Debian package redis-server; `cargo xtask setup` installs it)")?;
        let pid = child.id();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            // Ready once this very server answers on the port (a restart reuses the port:
            // another process that took it meanwhile must not pass for it).
            if self.server_pid().is_ok_and(|answered| answered == pid) {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!("redis-server exited ({status}){}", self.log_tail());
            }
            thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "redis-server on port {} did not answer PING{}",
            self.port,
            self.log_tail()
        )
    }

    /// The end of a TLS server's log (certificate and key errors land there), to append
    /// to an error.
    fn log_tail(&self) -> String {
        let Some(tls) = &self.tls else {
            return String::new();
        };
        let log = std::fs::read_to_string(tls.dir.join("redis.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        format!(
            "; its log ends: {}",
            lines[lines.len().saturating_sub(5)..].join(" | ")
        )
    }

    /// Kills the server (SIGKILL: no goodbye to the clients).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = wait_bounded(&mut child, Duration::from_secs(5));
        }
    }

    /// A new, empty server on the same port (a restart that lost every key and script),
    /// its ACL users made `users_after` later (as when a config manager, not an ACL file,
    /// makes them): clients that connect meanwhile are refused their login.
    pub fn restart_empty(&mut self, users_after: Duration) -> Result<()> {
        self.restart_without_users()?;
        thread::sleep(users_after);
        self.make_users()
    }

    /// Killed and started again on its port, empty and without its ACL users (a cluster
    /// node remembers its cluster: `nodes.conf` stays).
    pub fn restart_without_users(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }

    /// Makes again every ACL user made so far (after [`RedisServer::restart_without_users`]).
    pub fn make_users(&self) -> Result<()> {
        for (user, password, role) in &self.users {
            self.make_user(user, password, role)?;
        }
        Ok(())
    }

    /// One command through redis-cli; its reply as text.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let output = output_bounded(
            Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(args),
            Duration::from_secs(10),
        )?;
        if !output.status.success() {
            bail!("redis-cli {args:?} failed");
        }
        Ok(String::from_utf8_lossy(&output.stdout).to_string())
    }

    /// The server's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The pid of the server answering on the port (`INFO server`).
    fn server_pid(&self) -> Result<u32> {
        let info = self.cli(&["INFO", "server"])?;
        info.lines()
            .find_map(|line| line.trim().strip_prefix("process_id:"))
            .and_then(|pid| pid.parse().ok())
            .context("INFO server without process_id")
    }

    /// Calls of `command` since the server started (`INFO commandstats`).
    pub fn calls(&self, command: &str) -> Result<u64> {
        let info = self.cli(&["INFO", "commandstats"])?;
        let prefix = format!("cmdstat_{command}:calls=");
        Ok(info
            .lines()
            .find_map(|line| line.trim().strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|calls| calls.parse().ok())
            .unwrap_or(0))
    }

    /// CPU seconds the server has used (`INFO cpu`: user + sys).
    pub fn cpu_seconds(&self) -> Result<f64> {
        let info = self.cli(&["INFO", "cpu"])?;
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.trim().strip_prefix(&format!("{name}:")))
                .and_then(|value| value.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        Ok(field("used_cpu_user") + field("used_cpu_sys"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(self.data_dir());
    }
}
