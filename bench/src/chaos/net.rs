//! A network of its own for the campaign's cluster, so a nats node can be cut off: each node
//! runs in a network namespace joined to a bridge by a veth pair, and cutting a node sets its
//! veth down. Its connections then go silent without closing (no reset, no FIN), as in a real
//! partition: the peers and clients find out only by their own timeouts. Needs root and
//! iproute2; where it cannot be set up the campaign runs the cluster on loopback and the
//! partition faults are skipped, saying why.
//!
//! Names and the subnet derive from the campaign's pid, so two campaigns do not collide; what
//! this sets up is removed on drop, and on SIGTERM or SIGINT (the campaign tears its stack
//! down). A SIGKILLed campaign leaves it (`ip netns list` shows `tsc<pid>n<i>`); the next
//! campaign removes what a campaign no longer running left ([`sweep_orphans`]).

use std::process::Command;

use anyhow::{bail, Context, Result};
use turnstile_tests::Placement;

pub struct Net {
    bridge: String,
    /// Per node: (namespace, veth on the bridge's side, address).
    nodes: Vec<(String, String, String)>,
    /// The FORWARD rule letting the bridge's members talk (Docker's policy drops bridged
    /// traffic once `br_netfilter` is loaded).
    forward_rule: bool,
}

impl Net {
    /// A bridge and `n` namespaces on a /24 of their own.
    pub fn create(n: usize) -> Result<Self> {
        Self::create_for(n, std::process::id())
    }

    /// As [`Net::create`], named after `pid` (tests plant a dead campaign's network).
    fn create_for(n: usize, pid: u32) -> Result<Self> {
        let tag = tag(pid);
        let subnet = format!("10.{}.{}", 200 + (pid / 256) % 50, pid % 256);
        let mut net = Net {
            bridge: tag.clone(),
            nodes: Vec::new(),
            forward_rule: false,
        };
        ip(&["link", "add", &net.bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{subnet}.254/24"),
            "dev",
            &net.bridge,
        ])?;
        ip(&["link", "set", &net.bridge, "up"])?;
        net.forward_rule = iptables("-I", &net.bridge).is_ok();
        for i in 0..n {
            let (ns, veth, addr) = (
                format!("{tag}n{i}"),
                format!("{tag}v{i}"),
                format!("{subnet}.{}", i + 1),
            );
            ip(&["netns", "add", &ns])?;
            net.nodes.push((ns.clone(), veth.clone(), addr.clone()));
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["link", "set", &veth, "master", &net.bridge, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Where node `i` runs: its namespace and address.
    pub fn placement(&self, i: usize) -> Placement {
        Placement {
            netns: self
                .nodes
                .get(i)
                .map(|(ns, _, addr)| (ns.clone(), addr.clone())),
            store_dir: None,
        }
    }

    /// Cuts node `i` off: nothing in or out until [`Net::mend`].
    pub fn cut(&self, i: usize) -> Result<()> {
        ip(&["link", "set", self.veth(i)?, "down"])
    }

    pub fn mend(&self, i: usize) -> Result<()> {
        ip(&["link", "set", self.veth(i)?, "up"])
    }

    fn veth(&self, i: usize) -> Result<&str> {
        self.nodes
            .get(i)
            .map(|(_, veth, _)| veth.as_str())
            .with_context(|| format!("no node {i} in the campaign's network"))
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for (ns, veth, _) in &self.nodes {
            let _ = ip(&["link", "del", veth]);
            let _ = ip(&["netns", "del", ns]);
        }
        if self.forward_rule {
            let _ = iptables("-D", &self.bridge);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// The name of a campaign's bridge; its namespaces are `<tag>n<i>`, its veths `<tag>v<i>`.
fn tag(pid: u32) -> String {
    format!("tsc{}", pid % 10_000_000)
}

/// The campaign pid a bridge or namespace name carries (`tsc<pid>` or `tsc<pid>n<i>`).
fn owner(name: &str) -> Option<u32> {
    let digits: String = name
        .strip_prefix("tsc")?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Removes the namespaces, bridges and FORWARD rules of campaigns no longer running (one
/// SIGKILLed leaves them); returns what it removed.
pub fn sweep_orphans() -> Vec<String> {
    let dead = |name: &str| owner(name).is_some_and(|pid| !running(pid));
    let mut removed = Vec::new();
    for ns in listed(&["netns", "list"]).into_iter().filter(|n| dead(n)) {
        // Deleting a namespace deletes its end of each veth pair, and with it the pair.
        if ip(&["netns", "del", &ns]).is_ok() {
            removed.push(format!("netns {ns}"));
        }
    }
    for bridge in listed(&["-o", "link", "show", "type", "bridge"])
        .into_iter()
        .filter(|b| dead(b) && owner(b).map(tag).as_deref() == Some(b.as_str()))
    {
        let _ = iptables("-D", &bridge);
        if ip(&["link", "del", &bridge]).is_ok() {
            removed.push(format!("bridge {bridge}"));
        }
    }
    removed
}

/// The names `ip ARGS` lists (first word of each line; `ip -o link` puts `<n>: ` first).
fn listed(args: &[&str]) -> Vec<String> {
    let Ok(out) = Command::new("ip").args(args).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let first = words.next()?;
            let name = if first.ends_with(':') {
                words.next()?
            } else {
                first
            };
            Some(name.trim_end_matches(':').split('@').next()?.to_string())
        })
        .collect()
}

/// Whether a process of that pid exists (a reused pid counts as running: nothing is removed).
pub(crate) fn running(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn ip(args: &[&str]) -> Result<()> {
    run(Command::new("ip").args(args), "ip", args)
}

/// Inserts (`-I`) or deletes (`-D`) the rule accepting traffic between the bridge's ports.
fn iptables(op: &str, bridge: &str) -> Result<()> {
    let args = [op, "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"];
    run(Command::new("iptables").args(args), "iptables", &args)
}

fn run(command: &mut Command, name: &str, args: &[&str]) -> Result<()> {
    let out = command
        .output()
        .with_context(|| format!("{name} {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "{name} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use turnstile_tests::NatsServer;

    /// A node cut off goes silent (a request gets no answer, the connection stays open) and
    /// answers again once mended: what the partition fault relies on.
    #[tokio::test]
    async fn a_node_cut_off_goes_silent_and_answers_once_mended() -> Result<()> {
        let net = Net::create(1)?;
        let server = NatsServer::start_placed(None, net.placement(0)).await?;
        assert!(server.url().starts_with("nats://10."), "{}", server.url());
        let client = server.client().await?;
        let mut sub = client.subscribe("cut.echo").await?;
        let echo = client.clone();
        tokio::spawn(async move {
            while let Some(m) = futures::StreamExt::next(&mut sub).await {
                if let Some(reply) = m.reply {
                    let _ = echo.publish(reply, m.payload).await;
                }
            }
        });
        let ask = || {
            tokio::time::timeout(
                Duration::from_millis(500),
                client.request("cut.echo", "hi".into()),
            )
        };
        assert!(matches!(ask().await, Ok(Ok(_))), "answers before the cut");
        net.cut(0)?;
        assert!(ask().await.is_err(), "a cut node must not answer");
        assert_ne!(
            client.connection_state(),
            async_nats::connection::State::Disconnected,
            "a cut is silent: the connection is not closed"
        );
        net.mend(0)?;
        turnstile_tests::wait_until(
            "the node to answer again",
            Duration::from_secs(10),
            || async { Ok(matches!(ask().await, Ok(Ok(_))).then_some(())) },
        )
        .await?;
        Ok(())
    }

    /// The network a SIGKILLed campaign left behind is removed by the next campaign's sweep,
    /// and a running campaign's is left alone.
    #[test]
    fn a_dead_campaigns_network_is_swept_and_a_live_ones_kept() -> Result<()> {
        let mut child = Command::new("true").spawn()?;
        let dead_pid = child.id();
        child.wait()?;
        // A live "campaign": a process that runs while the sweep does.
        let mut alive = Command::new("sleep").arg("60").spawn()?;
        let dead = Net::create_for(2, dead_pid)?;
        let live = Net::create_for(1, alive.id())?;
        let (dead_tag, live_tag) = (tag(dead_pid), tag(alive.id()));
        let removed = sweep_orphans();
        let links = listed(&["-o", "link", "show"]);
        let namespaces = listed(&["netns", "list"]);
        drop(live);
        let _ = alive.kill();
        let _ = alive.wait();
        assert!(
            removed.contains(&format!("bridge {dead_tag}")),
            "{removed:?}"
        );
        assert!(
            !namespaces
                .iter()
                .any(|n| n.starts_with(&format!("{dead_tag}n"))),
            "{namespaces:?}"
        );
        assert!(!links.contains(&dead_tag), "{links:?}");
        assert!(links.contains(&live_tag), "the live one kept: {links:?}");
        assert!(
            namespaces.contains(&format!("{live_tag}n0")),
            "{namespaces:?}"
        );
        // What the sweep removed, the dead campaign's drop finds gone: no error, no panic.
        drop(dead);
        Ok(())
    }
}
