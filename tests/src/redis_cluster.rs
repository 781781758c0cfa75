//! A real Redis Cluster on loopback: three primaries and a replica of each, made with
//! `redis-cli --cluster create`, every node on a port picked here, with the same ACL users
//! on every node (ACL users are not shared by a cluster). Stopped on drop.

use crate::{
    proxy::Proxy,
    redis::{RedisServer, Role, Tls},
};
use anyhow::{bail, Context as _, Result};
use std::{
    path::PathBuf,
    process::Command,
    thread,
    time::{Duration, Instant},
};

pub struct RedisCluster {
    /// Every node, the three made primaries first.
    pub nodes: Vec<RedisServer>,
    dir: PathBuf,
    /// With TLS: the keys every node's copy came from (its CA is [`RedisCluster::ca`]).
    keys: Option<Tls>,
    /// From [`RedisCluster::start_proxied`]: each node's proxy, in the nodes' order, the
    /// only way clients reach the nodes (a delay, a black hole).
    pub proxies: Vec<Proxy>,
}

/// The cluster's directories: `{prefix}{pid}-{n}`.
pub const CLUSTER_PREFIX: &str = "shaper-redis-cluster-";

impl RedisCluster {
    /// `nodes` nodes, not yet joined, in a directory of their own; with `tls`, every node
    /// also listens for TLS with one certificate (one private CA's) and the bus speaks it.
    fn nodes(nodes: usize, tls: bool) -> Result<Self> {
        static CLUSTERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "{CLUSTER_PREFIX}{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
            keys: None,
            proxies: Vec::new(),
        };
        let keys = if tls { Some(Tls::new()?) } else { None };
        for _ in 0..nodes {
            let tls = keys.as_ref().map(Tls::copy_of).transpose()?;
            cluster
                .nodes
                .push(RedisServer::start_cluster_node(&cluster.dir, tls)?);
        }
        cluster.keys = keys;
        Ok(cluster)
    }

    /// `primaries` primaries (any number, one included) and no replica, the slots split
    /// evenly, joined by hand (`CLUSTER ADDSLOTSRANGE`, `CLUSTER MEET`): for the bench.
    pub fn start_without_replicas(primaries: usize) -> Result<Self> {
        let cluster = Self::nodes(primaries, false)?;
        cluster.join()?;
        Ok(cluster)
    }

    /// `primaries` primaries and no replica, as [`RedisCluster::start_without_replicas`],
    /// that clients reach only through [`RedisCluster::proxies`], one per node.
    pub fn start_proxied(primaries: usize) -> Result<Self> {
        let mut cluster = Self::nodes(0, false)?;
        for _ in 0..primaries {
            let (node, proxy) = RedisServer::start_proxied_cluster_node(&cluster.dir)?;
            cluster.nodes.push(node);
            cluster.proxies.push(proxy);
        }
        cluster.join()?;
        Ok(cluster)
    }

    /// Every node a primary of an even part of the slots, all met.
    fn join(&self) -> Result<()> {
        let primaries = self.nodes.len();
        for (index, node) in self.nodes.iter().enumerate() {
            let low = (16384 * index / primaries).to_string();
            let high = (16384 * (index + 1) / primaries - 1).to_string();
            node.cli(&["CLUSTER", "ADDSLOTSRANGE", &low, &high])?;
        }
        let first = &self.nodes[0];
        let (port, bus) = (first.port.to_string(), first.bus_port().unwrap_or_default());
        for node in &self.nodes[1..] {
            node.cli(&["CLUSTER", "MEET", "127.0.0.1", &port, &bus.to_string()])?;
        }
        self.wait_ok(Duration::from_secs(30))
    }

    /// `primaries` (three or more) primaries with one replica each, every slot served;
    /// with `tls`, reached by `rediss+cluster://` (the CA: [`RedisCluster::ca`]).
    pub fn start(primaries: usize, tls: bool) -> Result<Self> {
        let cluster = Self::nodes(2 * primaries, tls)?;
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        let output = crate::process::output_bounded(
            Command::new("redis-cli")
                .args(["--cluster", "create"])
                .args(&addresses)
                .args(["--cluster-replicas", "1", "--cluster-yes"]),
            Duration::from_secs(60),
        )?;
        if !output.status.success() {
            bail!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&output.stdout)
            );
        }
        cluster.wait_ok(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// Waits until every live node says `cluster_state:ok` and knows every node.
    fn wait_ok(&self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let states: Vec<String> = self
                .live()
                .map(|node| node.cli(&["CLUSTER", "INFO"]).unwrap_or_default())
                .collect();
            let known = format!("cluster_known_nodes:{}", self.nodes.len());
            if states
                .iter()
                .all(|info| info.contains("cluster_state:ok") && info.contains(&known))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the cluster is not ok after {limit:?}");
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    fn live(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes.iter().filter(|node| node.pid().is_some())
    }

    /// Adds `user` with `role`'s ACL on every node; a `redis+cluster://` URL naming the
    /// first three nodes.
    pub fn user(&mut self, user: &str, password: &str, role: Role) -> Result<String> {
        for node in &mut self.nodes {
            node.user(user, password, role.clone())?;
        }
        Ok(self.url_of(&format!("{user}:{password}@")))
    }

    /// `redis+cluster://{login}` (`rediss+cluster://` and the TLS ports with TLS) and the
    /// first three nodes.
    pub fn url_of(&self, login: &str) -> String {
        let nodes: Vec<String> = self
            .ports_of_clients()
            .into_iter()
            .take(3)
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        let scheme = if self.keys.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}+cluster://{login}{}", nodes.join(","))
    }

    /// The port clients reach each node at: its proxy's, its TLS port, or its own.
    fn ports_of_clients(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(index, node)| match self.proxies.get(index) {
                Some(proxy) => proxy.port,
                None => node.tls().map_or(node.port, |tls| tls.port),
            })
            .collect()
    }

    /// Every node killed at once, then started again on its port, empty but for its
    /// `nodes.conf` (so the cluster is the same one, after Redis's own delays), its ACL
    /// users made `users_after` later.
    pub fn restart_empty(&mut self, users_after: Duration) -> Result<()> {
        self.kill();
        for node in &mut self.nodes {
            node.restart_without_users()?;
        }
        thread::sleep(users_after);
        self.nodes.iter().try_for_each(RedisServer::make_users)
    }

    /// Every node killed (SIGKILL).
    pub fn kill(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }

    /// With TLS: a CA that signed no node's certificate.
    pub fn other_ca(&self) -> Option<PathBuf> {
        self.keys.as_ref().map(Tls::other_ca)
    }

    /// With TLS: the CA that signed every node's certificate.
    pub fn ca(&self) -> Option<PathBuf> {
        self.keys.as_ref().map(Tls::ca)
    }

    /// The index of the node that serves `key`'s slot now as its primary.
    pub fn primary_of(&self, key: &str) -> Result<usize> {
        let node = self.live().next().context("no node runs")?;
        let slot: u16 = node.cli(&["CLUSTER", "KEYSLOT", key])?.trim().parse()?;
        let shards = node.cli(&["CLUSTER", "NODES"])?;
        for line in shards.lines() {
            // ID ADDRESS FLAGS PRIMARY PING PONG EPOCH STATE SLOTS...
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let serves = fields[8..].iter().any(|range| {
                let (low, high) = range.split_once('-').unwrap_or((range, range));
                matches!((low.parse::<u16>(), high.parse::<u16>()), (Ok(l), Ok(h)) if (l..=h).contains(&slot))
            });
            if serves {
                let port: u16 = fields[1]
                    .split(['@', ':'])
                    .nth(1)
                    .and_then(|p| p.parse().ok())
                    .context("a node's address without a port")?;
                return self
                    .nodes
                    .iter()
                    .position(|n| n.port == port)
                    .or_else(|| self.proxies.iter().position(|p| p.port == port))
                    .context("a primary the lab did not start");
            }
        }
        bail!("no primary serves slot {slot}")
    }

    /// Whether node `index` is a primary now (`ROLE`).
    pub fn is_primary(&self, index: usize) -> bool {
        self.nodes[index]
            .cli(&["ROLE"])
            .is_ok_and(|role| role.lines().next() == Some("master"))
    }

    /// The replica of the primary at `index` (the node whose `ROLE` names its port).
    pub fn replica_of(&self, index: usize) -> Result<usize> {
        // A replica names the port it replicates from: the TLS one in a TLS cluster.
        let node = &self.nodes[index];
        let port = node.tls().map_or(node.port, |tls| tls.port).to_string();
        (0..self.nodes.len())
            .find(|&other| {
                other != index
                    && self.nodes[other].cli(&["ROLE"]).is_ok_and(|role| {
                        let lines: Vec<&str> = role.lines().collect();
                        lines.first() == Some(&"slave") && lines.get(2) == Some(&port.as_str())
                    })
            })
            .context("the primary has no replica")
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How long after `since` every node listening at `ports` said `cluster_state:ok` (asked
/// every 20 ms, for at most `limit`): a restarted cluster serves again only then.
pub fn ok_after(ports: &[u16], since: Instant, limit: Duration) -> Result<Duration> {
    let ok = |port: &u16| {
        crate::process::output_bounded(
            Command::new("redis-cli").args(["-p", &port.to_string(), "CLUSTER", "INFO"]),
            Duration::from_secs(2),
        )
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("cluster_state:ok"))
    };
    while since.elapsed() < limit {
        if ports.iter().all(ok) {
            return Ok(since.elapsed());
        }
        thread::sleep(Duration::from_millis(20));
    }
    bail!("the cluster was not ok {limit:?} after")
}
