//! A network of its own for the campaign's cluster, so a nats node can be cut off: each node
//! runs in a network namespace joined to a bridge by a veth pair, and cutting a node sets its
//! veth down. Its connections then go silent without closing (no reset, no FIN), as in a real
//! partition: the peers and clients find out only by their own timeouts. Needs root and
//! iproute2; where it cannot be set up the campaign runs the cluster on loopback and the
//! partition faults are skipped, saying why.
//!
//! Names and the subnet derive from the campaign's pid, so two campaigns do not collide; what
//! this sets up is removed on drop (a SIGKILLed campaign leaves it: `ip netns list` shows
//! `tsc<pid>n<i>`).

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
        let pid = std::process::id();
        let tag = format!("tsc{}", pid % 10_000_000);
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
}
