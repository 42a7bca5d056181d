//! R14: services and nats-server are SIGKILLed mid-work; no turn is typed twice or lost.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_tests::wait_until;

use crate::stack::{report, serial_turns, Stack};

/// R14: session-lane SIGKILLed while a turn runs, then started again; the turn is neither typed
/// again nor lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_lane_killed_mid_turn_neither_retypes_nor_loses_it() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = lane_killed(&mut stack).await;
    report(&stack, r)
}

async fn lane_killed(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("victim", None).await?;
    let texts = ["first, slow\n!sleep 3s", "second", "third"];
    let turns = stack.send_all(&s, &texts).await?;
    stack.wait_running(&turns[0]).await?;
    stack.kill_lane("a").await?;
    stack.spawn_lane("a2")?;
    stack.all_complete(&turns).await?;
    stack.typed_exactly_once(&s, &texts).await?;
    let order = serial_turns(&stack.events().await?, &s)?;
    ensure!(order == turns, "ran {order:?}, sent {turns:?}");
    Ok(())
}

/// R14: nats-server SIGKILLed and restarted on its store with messages queued; none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_with_queued_messages_loses_none() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = nats_killed(&mut stack).await;
    report(&stack, r)
}

async fn nats_killed(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("survivor", None).await?;
    let texts = ["one\n!sleep 2s", "two", "three", "four"];
    let turns = stack.send_all(&s, &texts).await?;
    stack.wait_running(&turns[0]).await?;
    stack.nats.kill().await?;
    stack.nats.restart().await?;
    stack.all_complete(&turns).await?;
    stack.typed_exactly_once(&s, &texts).await?;
    Ok(())
}

/// R1, R14: two replicas; one serves the session, and its death moves the lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_serving_replica_moves_the_lane_to_the_other() -> Result<()> {
    let mut stack = Stack::start(&["a", "b"], &["h1"]).await?;
    let r = failover(&mut stack).await;
    report(&stack, r)
}

async fn failover(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("moving", None).await?;
    let texts: Vec<String> = (0..6).map(|i| format!("step {i}\n!sleep 400ms")).collect();
    let turns = stack.send_all(&s, &texts).await?;
    stack.wait_running(&turns[1]).await?;
    let before = stack.events().await?;
    let servers: Vec<String> = before
        .iter()
        .filter(|e| e.kind == "turn.started" && e.session.as_ref() == Some(&s))
        .map(|e| e.data["replica"].as_str().unwrap_or_default().to_string())
        .collect();
    ensure!(
        servers.len() >= 2,
        "expected two started turns, got {servers:?}"
    );
    ensure!(
        servers.iter().all(|r| *r == servers[0]),
        "one session served by several replicas: {servers:?}"
    );
    let serving = servers[0].clone();
    let other = if serving == "a" { "b" } else { "a" };
    stack.kill_lane(&serving).await?;
    stack.all_complete(&turns).await?;
    let events = stack.events().await?;
    let order = serial_turns(&events, &s)?;
    ensure!(order == turns, "ran {order:?}, sent {turns:?}");
    let last = events
        .iter()
        .rev()
        .find(|e| e.kind == "turn.started" && e.session.as_ref() == Some(&s))
        .context("a started turn")?;
    ensure!(
        last.data["replica"] == other,
        "last turn served by {}, expected {other}",
        last.data["replica"]
    );
    stack.typed_exactly_once(&s, &texts).await?;
    Ok(())
}

/// R14 on the transport side: the transport agent is SIGKILLed while its agent works on a
/// turn. The turn was recorded `running` before it was typed, so the restarted transport only
/// watches it to its end (re-adopting the pane on its private tmux socket) and never types it
/// again; the turns behind it go into the same conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_killed_mid_turn_adopts_the_turn_without_retyping() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = transport_killed(&mut stack).await;
    report(&stack, r)
}

async fn transport_killed(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("adopted", None).await?;
    let texts = ["long one\n!sleep 3s", "after the restart"];
    let turns = stack.send_all(&s, &texts).await?;
    stack.wait_running(&turns[0]).await?;
    // Kill only once the agent has the message: the restarted transport must not retype it.
    restart_transport_once_received(stack, &s, texts[0]).await?;
    stack.all_complete(&turns).await?;
    stack.typed_exactly_once(&s, &texts).await?;
    Ok(())
}

/// A turn's command carries its queued record's revision, which spares the transport a read on
/// the hand-off. The command a restarted transport gets again still carries it, though the
/// turn is running in the agent: the record is read first, so the agent's busy pane is never
/// taken for one that does not come ready (a turn longer than the ready timeout would fail
/// `parent_transport_unavailable` while the agent works on), and the turn is adopted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_transport_adopts_a_turn_longer_than_the_ready_timeout() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = restarted_long_turn(&mut stack).await;
    report(&stack, r)
}

async fn restarted_long_turn(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::api::CreateSession;
    use turnstile_shared::records::AgentKind;
    let s = stack
        .create_session_with(CreateSession {
            agent: AgentKind::Mock,
            name: "adopted-long".into(),
            host: None,
            cwd: None,
            id: None,
            launch: None,
            ready_timeout_ms: Some(1000),
            policy: None,
        })
        .await?;
    let texts = ["longer than the ready timeout\n!sleep 6s", "after it"];
    let turns = stack.send_all(&s, &texts).await?;
    restart_transport_once_received(stack, &s, texts[0]).await?;
    stack.all_complete(&turns).await?;
    stack.typed_exactly_once(&s, &texts).await?;
    Ok(())
}

/// A replica stopped gracefully (SIGTERM, as in a rolling upgrade) hands its lanes over at once:
/// with pin TTL and ack wait of 60 s, the other replica must take the session's queue well
/// before either could expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_stop_hands_lanes_over_without_waiting_for_the_pin() -> Result<()> {
    let slow = [
        ("TURNSTILE_LANE_PIN_TTL", "60s"),
        ("TURNSTILE_LANE_ACK_WAIT", "60s"),
    ];
    let mut stack = Stack::start_with(&["a", "b"], &["h1"], &slow).await?;
    let r = graceful(&mut stack).await;
    report(&stack, r)
}

async fn graceful(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("upgraded", None).await?;
    let texts: Vec<String> = (0..4).map(|i| format!("part {i}\n!sleep 500ms")).collect();
    let turns = stack.send_all(&s, &texts).await?;
    stack.wait_running(&turns[0]).await?;
    let events = stack.events().await?;
    let serving = events
        .iter()
        .find(|e| e.kind == "turn.started" && e.session.as_ref() == Some(&s))
        .and_then(|e| e.data["replica"].as_str())
        .context("a started turn")?
        .to_string();
    let pid = stack
        .lanes
        .get(&serving)
        .and_then(|p| p.pid())
        .context("serving pid")?;
    crate::stack::signal(pid, rustix::process::Signal::TERM)?;
    stack
        .all_complete_within(&turns, Duration::from_secs(20))
        .await?;
    stack.typed_exactly_once(&s, &texts).await?;
    ensure!(
        serial_turns(&stack.events().await?, &s)? == turns,
        "turns out of order"
    );
    Ok(())
}

/// R14, fail-over in seconds: with a 60 s pin TTL and ack wait (what protects slow turns),
/// a SIGKILLed replica's lanes are still served by the survivor well before either expires:
/// the busy lane's item in flight is given back and resumed (typed once, in order), and an
/// idle lane pinned to the dead replica takes its next turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_lanes_move_within_seconds_despite_long_timeouts() -> Result<()> {
    let slow = [
        ("TURNSTILE_LANE_PIN_TTL", "60s"),
        ("TURNSTILE_LANE_ACK_WAIT", "60s"),
    ];
    // Replica `a` alone first, so it holds every lane; `b` joins before `a` is killed.
    let mut stack = Stack::start_with(&["a"], &["h1"], &slow).await?;
    let r = killed_fast(&mut stack).await;
    report(&stack, r)
}

/// A lane pinned to a pin no replica holds, with nothing in flight and an item waiting: the
/// state `turnstile-bench scale` found on idle lanes whose first item came as their replica
/// was SIGKILLed (the server pinned a request of the dead connection). No pin record names
/// such a lane, so the take-over's sweep must find it; without the sweep the turn waits out
/// the 60 s pin TTL. Made by hand here: a client no replica knows takes the lane's pin with
/// one message, acks it and goes, while the lane's replica is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_stranded_on_a_pin_nobody_holds_is_freed_by_the_take_over() -> Result<()> {
    let slow = [
        ("TURNSTILE_LANE_PIN_TTL", "60s"),
        ("TURNSTILE_LANE_ACK_WAIT", "60s"),
    ];
    let mut stack = Stack::start_with(&["a"], &["h1"], &slow).await?;
    let r = async {
        let s = stack.create_session("stranded", None).await?;
        turnstile_tests::wait_lanes_pulled(&stack.js, &[&s], 1, Duration::from_secs(20)).await?;
        stack.kill_lane("a").await?;
        // The dead replica's waiting pull goes once the server has seen its connection
        // close; until then it could take the stranger's message.
        turnstile_tests::wait_until(
            "the killed replica's pull request gone",
            Duration::from_secs(10),
            || async {
                let mut consumer: async_nats::jetstream::consumer::PullConsumer = stack
                    .js
                    .get_stream(turnstile_shared::subjects::LANE_STREAM)
                    .await?
                    .get_consumer(&turnstile_shared::subjects::lane_consumer(&s))
                    .await
                    .map_err(|e| anyhow::anyhow!("lane consumer: {e}"))?;
                Ok((consumer.info().await?.num_waiting == 0).then_some(()))
            },
        )
        .await?;
        strand(&stack, &s).await?;
        let pinned = lane_pin(&stack, &s).await?;
        ensure!(pinned.is_some(), "the lane is pinned to the stranger");

        stack.spawn_lane("b")?;
        stack.wait_serving(true).await?;
        let started = std::time::Instant::now();
        let t = stack.send(&s, "after the stranger\n!reply freed").await?;
        stack.wait_turn(&t, Duration::from_secs(40)).await?;
        ensure!(server_of(&stack, &s).await? == "b", "b serves the lane");
        ensure!(
            lane_pin(&stack, &s).await? != pinned,
            "the stranger's pin was let go"
        );
        ensure!(
            stack
                .logs()
                .contains("unpinned lanes stranded on a pin nobody holds"),
            "the sweep freed it (after {:?})",
            started.elapsed()
        );
        Ok(())
    }
    .await;
    report(&stack, r)
}

/// Pins `s`'s lane to a client no replica knows: it pulls in the lane's group, takes one
/// message (not a lane item: it is acked, and readers skip what is at or below the ack
/// floor), and closes its connection. The pin stays until the pin TTL.
async fn strand(stack: &Stack, s: &turnstile_shared::SessionId) -> Result<()> {
    use futures::StreamExt;
    use turnstile_shared::subjects;
    // On the lanes' own identity: only it may pull lane consumers.
    let (stranger, _) = stack.connect_as("session-lane").await?;
    // The pull request as a lane sends it (async-nats's pull streams refuse pinned
    // consumers): one message, in the lane's group.
    let inbox = stranger.new_inbox();
    let mut replies = stranger.subscribe(inbox.clone()).await?;
    let request = serde_json::json!({
        "batch": 1,
        "expires": 10_000_000_000u64,
        "group": subjects::LANE_GROUP,
    });
    stranger
        .publish_with_reply(subjects::lane_pull(s), inbox, request.to_string().into())
        .await?;
    stranger.flush().await?;
    stack
        .js
        .publish(subjects::lane(s), "not a lane item".into())
        .await?
        .await?;
    let msg = tokio::time::timeout(Duration::from_secs(10), replies.next())
        .await
        .context("the stranger's message")?
        .context("inbox closed")?;
    ensure!(
        msg.headers
            .as_ref()
            .and_then(|h| h.get("Nats-Pin-Id"))
            .is_some(),
        "the stranger was pinned: {:?}",
        msg.headers
    );
    let ack = msg.reply.context("an ack subject")?;
    stranger.request(ack, "+ACK".into()).await?;
    drop(replies);
    stranger.drain().await?;
    Ok(())
}

/// The pin id `s`'s lane is held by, if any.
async fn lane_pin(stack: &Stack, s: &turnstile_shared::SessionId) -> Result<Option<String>> {
    use turnstile_shared::subjects;
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = stack
        .js
        .get_stream(subjects::LANE_STREAM)
        .await?
        .get_consumer(&subjects::lane_consumer(s))
        .await
        .map_err(|e| anyhow::anyhow!("lane consumer: {e}"))?;
    let info = consumer.info().await?;
    Ok(info
        .priority_groups
        .iter()
        .find(|g| g.group == subjects::LANE_GROUP)
        .and_then(|g| g.pinned_client_id.clone()))
}

/// The same fail-over after a restart of the (single) nats-server: replica liveness keeps
/// working across it. Its bucket was memory-stored once, so a restart dropped it: renewals
/// failed from then on, a replica started afterwards could not bind, and a killed replica's
/// lanes waited out the pin TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_liveness_survives_a_nats_restart() -> Result<()> {
    let slow = [
        ("TURNSTILE_LANE_PIN_TTL", "60s"),
        ("TURNSTILE_LANE_ACK_WAIT", "60s"),
    ];
    let mut stack = Stack::start_with(&["a"], &["h1"], &slow).await?;
    let r = async {
        stack.nats.kill().await?;
        stack.nats.restart().await?;
        killed_fast(&mut stack).await
    }
    .await;
    report(&stack, r)
}

/// A survivor that was itself slow a moment before the kill (here SIGSTOPped for half a
/// second, its connection kept: its own renewals come back late through its watch, as under
/// load) still takes the killed peer for dead on the server's word (its connection gone) in
/// a few hundred milliseconds. Such a gap used to turn the fast path off for the whole silence
/// timeout, and the claim came by silence after 1.25 s: in `turnstile-bench failover`, most
/// slow detections were that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_survivor_slow_just_before_the_kill_still_detects_it_from_the_server() -> Result<()> {
    let mut stack = Stack::start_with(&["a"], &["h1"], &[]).await?;
    let r = slow_survivor(&mut stack).await;
    report(&stack, r)
}

async fn slow_survivor(stack: &mut Stack) -> Result<()> {
    use futures::StreamExt;
    stack.spawn_lane("b")?;
    // `b` watching `a` for longer than the silence timeout (its own start counts as a
    // reconnect: peers may only be slow to come back), as its live key's `since` says.
    let replicas = stack
        .js
        .get_key_value(turnstile_shared::subjects::REPLICAS_BUCKET)
        .await?;
    wait_until("b renewing for 3 s", Duration::from_secs(30), || {
        let replicas = replicas.clone();
        async move {
            let mut keys = replicas.keys().await?;
            while let Some(key) = keys.next().await {
                let Some(v) = replicas.get(&key?).await? else {
                    continue;
                };
                let v: serde_json::Value = serde_json::from_slice(&v)?;
                let since = v["since"]
                    .as_str()
                    .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok());
                if let (Some("b"), Some(since)) = (v["replica"].as_str(), since) {
                    let up = chrono::Utc::now() - since.with_timezone(&chrono::Utc);
                    return Ok((up > chrono::Duration::seconds(3)).then_some(()));
                }
            }
            Ok(None)
        }
    })
    .await?;
    let b_pid = stack.freeze_lane("b")?;
    // The fault itself: half a second stopped, past its 200 ms lease, short of the 1.25 s a
    // peer waits before it takes a silent replica for dead.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let resumed_at = stack.lane_log("b")?.len();
    crate::stack::signal(b_pid, rustix::process::Signal::CONT)?;
    stack.kill_lane("a").await?;
    let since_resume = || -> Result<String> {
        Ok(stack
            .lane_log("b")?
            .get(resumed_at..)
            .unwrap_or_default()
            .to_string())
    };
    let claim = wait_until("b claims a", Duration::from_secs(15), || async {
        Ok(since_resume()?
            .lines()
            .find(|l| l.contains("claimed a dead replica"))
            .map(str::to_string))
    })
    .await?;
    let since_resume = since_resume()?;
    ensure!(
        since_resume.contains("own renewals stalled"),
        "b's own renewals did not stall: the case is not made\n{since_resume}"
    );
    ensure!(
        claim.contains("its connection is gone from the server"),
        "b claimed a by silence, not on the server's word: {claim}"
    );
    let silent_ms: u64 = claim
        .split_whitespace()
        .find_map(|w| w.strip_prefix("silent_ms="))
        .context("silent_ms in the claim")?
        .parse()?;
    ensure!(
        silent_ms < 1_000,
        "b claimed a only after {silent_ms} ms of silence (the fast path was off): {claim}"
    );
    Ok(())
}

/// The replica that served the session's last started turn.
async fn server_of(stack: &Stack, s: &turnstile_shared::SessionId) -> Result<String> {
    stack
        .events()
        .await?
        .iter()
        .rev()
        .find(|e| e.kind == "turn.started" && e.session.as_ref() == Some(s))
        .and_then(|e| e.data["replica"].as_str())
        .map(str::to_string)
        .context("a started turn")
}

async fn killed_fast(stack: &mut Stack) -> Result<()> {
    // Both lanes take a first turn from `a` alone: `a` holds both pins.
    let idle = stack.create_session("idle", None).await?;
    let busy = stack.create_session("busy", None).await?;
    for s in [&idle, &busy] {
        let warm = stack.send(s, "warm-up\n!reply ok").await?;
        stack.wait_turn(&warm, Duration::from_secs(20)).await?;
    }
    stack.spawn_lane("b")?;
    turnstile_tests::wait_lanes_pulled(&stack.js, &[&idle, &busy], 2, Duration::from_secs(20))
        .await?;
    let texts: Vec<String> = (0..4).map(|i| format!("part {i}\n!sleep 500ms")).collect();
    let turns = stack.send_all(&busy, &texts).await?;
    stack.wait_running(&turns[1]).await?;
    ensure!(
        server_of(stack, &busy).await? == "a",
        "a serves the busy session"
    );
    stack.kill_lane("a").await?;
    // A request sent as the replica dies may have gone to it: retried with the same turn id,
    // as a client of a dying replica would.
    let after = turnstile_shared::TurnId::new();
    let req = turnstile_shared::api::SendTurn {
        session: idle.clone(),
        text: "after the kill\n!reply moved".into(),
        turn: Some(after.clone()),
    };
    for attempt in 1.. {
        let sent: Result<turnstile_shared::records::TurnRecord, _> = turnstile_shared::api::call(
            &stack.client,
            turnstile_shared::subjects::api::SESSION_SEND,
            &req,
            crate::stack::API,
        )
        .await;
        match sent {
            Ok(_) => break,
            Err(e) if e.code.is_transient() && attempt < 3 => continue,
            Err(e) => anyhow::bail!("send after the kill: {e}"),
        }
    }
    // Well under the 60 s either timeout would take.
    let mut all = turns.clone();
    all.push(after);
    stack
        .all_complete_within(&all, Duration::from_secs(15))
        .await?;
    ensure!(
        server_of(stack, &idle).await? == "b",
        "the idle lane's turn was not served by the survivor"
    );
    let mut typed = vec!["warm-up\n!reply ok".to_string()];
    typed.extend(texts.iter().cloned());
    stack.typed_exactly_once(&busy, &typed).await?;
    let order = serial_turns(&stack.events().await?, &busy)?;
    ensure!(order.ends_with(&turns), "turns out of order: {order:?}");
    Ok(())
}

/// R14, broker fail-over in seconds: a broker replica holding a step's end on the ended
/// queue (delivered to it, never acked: it is frozen, then SIGKILLed) loses it to the surviving
/// replica within the broker queues' short ack wait, although the transport ack wait is 60 s.
/// The end is a cancel (`turnstile cancel`), which only the queue carries: a reported end is
/// also recorded at once by the replica that took the report, so it would not wait on the
/// queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_brokers_messages_move_within_seconds() -> Result<()> {
    let slow = [("TURNSTILE_TRANSPORT_ACK_WAIT", "60s")];
    let mut stack = Stack::start_with(&["a"], &["h1"], &slow).await?;
    let r = broker_killed_fast(&mut stack).await;
    report(&stack, r)
}

async fn broker_killed_fast(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::{exec_reason, ExecStatus};
    use turnstile_shared::subjects::{self, api};
    use turnstile_shared::ExecutionId;
    let s = stack.create_session("broker-failover", None).await?;
    // Neither the step nor its turn ends on its own during the exchange.
    let t = stack.send(&s, "!step slow 95s\n!sleep 60s").await?;
    let tx = ExecutionId::from(&t);
    let tree = crate::stack::wait_until_tree(stack, &tx, Duration::from_secs(20), |t| {
        t.nodes.len() == 1 && t.nodes[0].record.status.name() == "running"
    })
    .await?;
    let step = tree.nodes[0].record.id.clone();
    // b1 is frozen with its pull on the ended queue registered: the oldest waiting pull, so
    // the step's end (queued by the cancel through either replica) is delivered to b1 and
    // sits there unacked.
    stack.freeze_broker("b1")?;
    stack.spawn_broker("b2")?;
    let ends = stack
        .js
        .get_stream(subjects::STEP_STREAM)
        .await?
        .get_consumer::<async_nats::jetstream::consumer::pull::Config>(
            subjects::BROKER_ENDED_CONSUMER,
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // The cancel is a call to the broker's queue group: one taken by the frozen replica goes
    // unanswered, and the operator calls again.
    let cancel = api::exec(api::OPERATOR, api::CANCEL);
    let req = turnstile_shared::step_api::ExecRef { id: step.clone() };
    wait_until("the cancel taken", Duration::from_secs(60), || {
        let (client, cancel, req) = (stack.client.clone(), cancel.clone(), req.clone());
        async move {
            let answer = turnstile_shared::api::call::<_, serde_json::Value>(
                &client,
                &cancel,
                &req,
                Duration::from_secs(3),
            )
            .await;
            match answer {
                Ok(_) => Ok(Some(())),
                Err(e) if e.code.is_transient() => Ok(None),
                Err(e) => Err(anyhow::anyhow!("cancel refused: {e}")),
            }
        }
    })
    .await?;
    // Usually b1's pull, the oldest, gets the end and the test shows it moving within
    // seconds. When it does not arise (b1's pull had expired), that is said, and the end
    // only has to arrive at all.
    let shared: &Stack = stack;
    let held = wait_until(
        "the step's end held by the frozen broker, or recorded by the other",
        Duration::from_secs(20),
        || {
            let mut ends = ends.clone();
            let step = step.clone();
            async move {
                let info = ends.info().await.map_err(|e| anyhow::anyhow!("{e}"))?;
                if info.num_ack_pending > 0 {
                    return Ok(Some(true));
                }
                let ended = shared
                    .exec(&step)
                    .await?
                    .is_some_and(|r| r.status.is_terminal());
                Ok(ended.then_some(false))
            }
        },
    )
    .await
    .unwrap_or(false);
    stack.brokers.get_mut("b1").context("b1")?.kill().await?;
    let bound = if held {
        Duration::from_secs(15)
    } else {
        eprintln!("the step's end was not held by the frozen broker: the hand-over did not arise in this run");
        Duration::from_secs(90)
    };
    let rec = stack
        .wait_exec(&step, bound, |r| r.status.is_terminal())
        .await?;
    ensure!(
        matches!(&rec.status, ExecStatus::Cancelled { reason, .. } if reason == exec_reason::CANCELLED),
        "the step ended {:?}",
        rec.status
    );
    // The survivor that recorded the cancel told the worker: the command is stopped (R7).
    let mark = format!("TURNSTILE_STEP={}", step.as_step().context("a step")?);
    wait_until("the cancelled step's command stopped", bound, || {
        let found = process_with_env(&mark);
        async move { Ok((!found).then_some(())) }
    })
    .await?;
    // The message the dead replica held went to the survivor, which recorded it and acked
    // it: the queue drains (the worker's own report of the cancel finds the end recorded).
    stack.wait_ended_drained().await
}

/// R7 while the broker does not answer: a step's heartbeats go unanswered (its only broker
/// is frozen), and a cancel for it (as a broker replica sends it) still stops its command at
/// once: a heartbeat in flight never keeps the runner from the command's exit or a cancel.
/// The cancelled end is reported once a broker answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_stops_at_once_when_cancelled_while_its_broker_is_frozen() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = cancelled_while_frozen(&mut stack).await;
    report(&stack, r)
}

async fn cancelled_while_frozen(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::{exec_reason, ExecStatus};
    use turnstile_shared::ExecutionId;
    let s = stack.create_session("frozen-broker-cancel", None).await?;
    let t = stack.send(&s, "!step hold 97s\n!sleep 60s").await?;
    let tree = crate::stack::wait_until_tree(
        stack,
        &ExecutionId::from(&t),
        Duration::from_secs(20),
        |t| t.nodes.len() == 1 && t.nodes[0].record.status.name() == "running",
    )
    .await?;
    let exec = tree.nodes[0].record.id.clone();
    let step = exec.as_step().context("a step")?;
    let mark = format!("TURNSTILE_STEP={step}");
    wait_until(
        "the step's command running",
        Duration::from_secs(20),
        || {
            let found = process_with_env(&mark);
            async move { Ok(found.then_some(())) }
        },
    )
    .await?;
    stack.freeze_broker("b1")?;
    // A heartbeat has gone to the frozen broker and timed out: the runner has met a broker
    // that does not answer.
    let log = stack
        .transports
        .get("h1")
        .context("h1")?
        .log_path()
        .to_path_buf();
    let said = format!("step={step}");
    wait_until("a heartbeat unanswered", Duration::from_secs(30), || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let seen = text
            .lines()
            .any(|l| l.contains(&said) && (l.contains("unanswered") || l.contains("unreachable")));
        async move { Ok(seen.then_some(())) }
    })
    .await?;
    let (broker, _) = stack.connect_as("notification-broker").await?;
    broker
        .publish(
            turnstile_shared::subjects::step_cancel(&step),
            "cancel".into(),
        )
        .await?;
    broker.flush().await?;
    wait_until(
        "the cancelled step's command stopped",
        Duration::from_secs(10),
        || {
            let found = process_with_env(&mark);
            async move { Ok((!found).then_some(())) }
        },
    )
    .await?;
    stack.brokers.get_mut("b1").context("b1")?.kill().await?;
    stack.spawn_broker("b2")?;
    let rec = stack
        .wait_exec(&exec, Duration::from_secs(30), |r| r.status.is_terminal())
        .await?;
    ensure!(
        matches!(&rec.status, ExecStatus::Failed { reason, .. } if reason == exec_reason::CANCELLED),
        "the step ended {:?}",
        rec.status
    );
    Ok(())
}

/// Whether a process runs with `entry` (`NAME=value`) in its environment.
fn process_with_env(entry: &str) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten().any(|e| {
        std::fs::read(e.path().join("environ"))
            .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == entry.as_bytes()))
    })
}

/// A replica taken for dead that was only paused (SIGSTOP: a long GC-like stall or a
/// partition) is fenced: the survivor serves its lanes meanwhile, and when the paused replica
/// runs again its lease has lapsed (`liveness::lease`), so it neither acks, gives back nor
/// starts anything for the lane it lost before finding its liveness key gone and exiting with
/// an error. No message is typed twice (R1, R14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_paused_past_its_liveness_is_fenced_and_exits() -> Result<()> {
    let slow = [
        ("TURNSTILE_LANE_PIN_TTL", "60s"),
        ("TURNSTILE_LANE_ACK_WAIT", "60s"),
    ];
    let mut stack = Stack::start_with(&["a"], &["h1"], &slow).await?;
    let r = paused_fenced(&mut stack).await;
    report(&stack, r)
}

async fn paused_fenced(stack: &mut Stack) -> Result<()> {
    use futures::StreamExt;
    let s = stack.create_session("fenced", None).await?;
    let warm = stack.send(&s, "warm-up\n!reply ok").await?;
    stack.wait_turn(&warm, Duration::from_secs(20)).await?;
    stack.spawn_lane("b")?;
    turnstile_tests::wait_lanes_pulled(&stack.js, &[&s], 2, Duration::from_secs(20)).await?;
    let texts = ["fence 0\n!sleep 2s", "fence 1\n!sleep 500ms"];
    let turns = stack.send_all(&s, &texts).await?;
    stack.wait_running(&turns[0]).await?;
    // Every lane item a delivered so far has a consumer sequence up to this one: an ack,
    // nak or progress ack on one of those after it resumes could only come from a.
    let consumer = turnstile_shared::subjects::lane_consumer(&s);
    let a_delivered = stack
        .js
        .get_stream(turnstile_shared::subjects::LANE_STREAM)
        .await?
        .consumer_info(&consumer)
        .await?
        .delivered
        .consumer_sequence;
    let a = stack.freeze_lane("a")?;
    stack
        .all_complete_within(&turns, Duration::from_secs(15))
        .await?;
    ensure!(server_of(stack, &s).await? == "b", "b serves the lane");
    // What a resumed a might say for the lane it lost: acks of its items, and turns it
    // starts (every dispatch announces `turn.started` with its replica first).
    let mut acks = stack
        .client
        .subscribe(format!(
            "$JS.ACK.{}.{consumer}.>",
            turnstile_shared::subjects::LANE_STREAM
        ))
        .await?;
    let mut events = stack
        .client
        .subscribe(turnstile_shared::subjects::session_events(&s))
        .await?;
    stack.client.flush().await?;
    crate::stack::signal(a, rustix::process::Signal::CONT)?;
    let status = stack
        .lanes
        .get_mut("a")
        .context("a")?
        .wait_exit(Duration::from_secs(15))
        .await?;
    ensure!(!status.success(), "the fenced replica exited with {status}");
    let said = stack
        .lanes
        .get("a")
        .map(|p| std::fs::read_to_string(p.log_path()).unwrap_or_default())
        .unwrap_or_default();
    ensure!(
        said.contains("taken for dead"),
        "the fenced replica did not say why it stopped:\n{}",
        said.lines().rev().take(40).collect::<Vec<_>>().join("\n")
    );
    // Whatever a sent before its connection closed has reached the server by now; one round
    // trip of ours lets the server pass it on.
    stack.client.flush().await?;
    let mut a_acks = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), acks.next()).await {
        if ack_consumer_seq(&m.subject, &consumer).is_some_and(|c| c <= a_delivered) {
            a_acks.push(String::from_utf8_lossy(&m.payload).into_owned());
        }
    }
    ensure!(
        a_acks.is_empty(),
        "the fenced replica acked items of the lane it lost: {a_acks:?}"
    );
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), events.next()).await {
        let body = String::from_utf8_lossy(&m.payload);
        ensure!(
            !(m.subject.ends_with("turn.started") && body.contains("\"replica\":\"a\"")),
            "the fenced replica started a turn on the lane it lost: {body}"
        );
    }
    let mut typed = vec!["warm-up\n!reply ok".to_string()];
    typed.extend(texts.iter().map(|t| t.to_string()));
    stack.typed_exactly_once(&s, &typed).await?;
    Ok(())
}

/// The consumer sequence of a lane ack subject
/// (`$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>`,
/// with a domain and account hash before the stream in the longer form).
fn ack_consumer_seq(subject: &str, consumer: &str) -> Option<u64> {
    let tokens: Vec<&str> = subject.split('.').collect();
    let at = tokens.iter().position(|t| *t == consumer)?;
    tokens.get(at + 3)?.parse().ok()
}

/// R1 across a NATS restart: an idle lane's waiting pull request dies with the server, and
/// the replica renews it as soon as it has reconnected (one shared reply subscription serves
/// every lane, `lane/pull.rs`). With a pin TTL of 120 s the request would otherwise only be
/// renewed when it expires (40 s later), far beyond this test's 20 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_lane_is_served_right_after_a_nats_restart() -> Result<()> {
    let slow = [("TURNSTILE_LANE_PIN_TTL", "120s")];
    let mut stack = Stack::start_with(&["a"], &["h1"], &slow).await?;
    let r = idle_through_restart(&mut stack).await;
    report(&stack, r)
}

async fn idle_through_restart(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("idle-across", None).await?;
    let warm = stack.send_all(&s, &["warm up"]).await?;
    stack.all_complete(&warm).await?;
    // Idle: its lane has taken the warm-up's ack (a lane still finishing as the server dies is
    // `a_lane_finishing_as_nats_dies_serves_its_next_turn_without_waiting_out_lost_replies`).
    stack.wait_idle(&s).await?;
    stack.nats.kill().await?;
    stack.nats.restart().await?;
    let turn = send_after_restart(stack, &s, "after the restart").await?;
    stack
        .all_complete_within(&[turn], Duration::from_secs(20))
        .await?;
    stack
        .typed_exactly_once(&s, &["warm up", "after the restart"])
        .await?;
    Ok(())
}

/// Sends a turn once the session API answers again after a server restart (its replica has
/// reconnected). The retries carry one turn id, so a send that got through without its
/// reply is not sent twice.
async fn send_after_restart(
    stack: &Stack,
    s: &turnstile_shared::SessionId,
    text: &str,
) -> Result<turnstile_shared::TurnId> {
    let req = turnstile_shared::api::SendTurn {
        session: s.clone(),
        text: text.into(),
        turn: Some(turnstile_shared::TurnId::new()),
    };
    wait_until(
        "the session API after the restart",
        Duration::from_secs(20),
        || async {
            let sent: Result<turnstile_shared::records::TurnRecord, _> =
                turnstile_shared::api::call(
                    &stack.client,
                    turnstile_shared::subjects::api::SESSION_SEND,
                    &req,
                    crate::stack::API,
                )
                .await;
            Ok(sent.ok().map(|r| r.id))
        },
    )
    .await
}

/// A lane finishing a turn as the server dies (its lane ack and outcome event sent, their
/// replies lost with the connection) serves its next turn right after the restart, not after
/// the 5 s JetStream request timeout those replies would otherwise be waited for. Each
/// round kills the server the moment a turn is seen completed, which lands inside the lane's
/// finish most of the time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_finishing_as_nats_dies_serves_its_next_turn_without_waiting_out_lost_replies(
) -> Result<()> {
    let slow = [("TURNSTILE_LANE_PIN_TTL", "120s")];
    let mut stack = Stack::start_with(&["a"], &["h1"], &slow).await?;
    let r = finishing_through_restarts(&mut stack).await;
    report(&stack, r)
}

async fn finishing_through_restarts(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("finishing-across", None).await?;
    let mut texts = vec!["round 0".to_string()];
    let first = stack.send_all(&s, &texts).await?;
    stack.all_complete(&first).await?;
    for round in 1..=4 {
        stack.nats.kill().await?;
        stack.nats.restart().await?;
        let text = format!("round {round}");
        let turn = send_after_restart(stack, &s, &text).await?;
        // Under the 5 s request timeout a lost reply was waited for.
        stack
            .all_complete_within(&[turn], Duration::from_secs(3))
            .await
            .with_context(|| format!("round {round}"))?;
        texts.push(text);
    }
    stack.typed_exactly_once(&s, &texts).await?;
    Ok(())
}

/// Waits until the session's agent has received `text`, then SIGKILLs host h1's transport
/// and starts it again: a restarted transport must neither retype the turn nor lose it.
async fn restart_transport_once_received(
    stack: &mut Stack,
    s: &turnstile_shared::SessionId,
    text: &str,
) -> Result<()> {
    wait_until(
        "the agent to receive the long turn",
        Duration::from_secs(20),
        || async {
            Ok(stack
                .transcript(s)
                .await
                .ok()
                .filter(|t| t.iter().any(|m| m == text)))
        },
    )
    .await?;
    stack
        .transports
        .get_mut("h1")
        .context("host h1")?
        .kill()
        .await?;
    stack.spawn_transport("h1")
}
