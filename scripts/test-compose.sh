#!/usr/bin/env bash
# The compose deployment, for real: images built here without a registry
# (scripts/build-images.sh), docker-compose.yml's cluster profile (three nats-server nodes,
# three copies of every stream and bucket) brought up on them, every healthcheck healthy, a
# scheduled run of the mock agent completed end to end through the containers, and a transport
# agent outside compose running a turn.
# Skips (exit 0, with the reason) when no Docker engine answers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! docker info >/dev/null 2>&1; then
  echo "test-compose: SKIPPED: no Docker engine answers (docker info failed)"
  exit 0
fi
if ! command -v docker-compose >/dev/null; then
  echo "test-compose: SKIPPED: docker-compose is not installed"
  exit 0
fi

scripts/build-images.sh
bin="target/${TURNSTILE_PROFILE:-release}"

project="tstest$$"
work="$(mktemp -d)"
compose() {
  docker-compose -p "$project" --env-file "$work/env" --compatibility --profile cluster "$@"
}
# Everything this script says on stderr is kept too, so that the failure's own words can be
# repeated after the deployment's logs (CI shows a run's tail; the logs pushed them out of it).
exec 2> >(tee -a "$work/stderr" >&2)
cleanup() {
  status=$?
  if [ "$status" -ne 0 ]; then
    reason="$(tail -n 12 "$work/stderr" 2>/dev/null || true)"
    echo "test-compose: FAILED; the deployment's logs:" >&2
    compose logs --no-color --tail 60 >&2 || true
    # Last, so that a log cut to its tail still says what failed.
    for f in "$work"/*.out; do
      [ -s "$f" ] && { echo "--- $(basename "$f"):"; tail -20 "$f"; } >&2
    done
    echo "--- what this script said last, before the logs:" >&2
    printf '%s\n' "$reason" >&2
    echo "test-compose: FAILED at: ${stage:-start-up} (exit $status)" >&2
  fi
  if [ -n "${outside_pid:-}" ]; then kill "$outside_pid" 2>/dev/null || true; fi
  if [ -n "${outside_data:-}" ]; then
    tmux -S "$outside_data/tmux.sock" kill-server 2>/dev/null || true
  fi
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT

# Secrets: a password per user of deploy/nats-server.conf and the agents' signing key. They
# start with a letter: nats-server parses a variable's value as a config value, and one that
# starts with a digit is read as a number (and refused).
secret() { printf 'pw%s' "$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"; }
# The shipped cluster config's hosts plus one outside compose: a transport agent on this
# machine.
"$bin/turnstile" admin nats-config --host host-a --host host-b --host outside \
  --cluster-name turnstile --route nats://nats:6222 --route nats://nats-2:6222 \
  --route nats://nats-3:6222 > "$work/nats-server.conf"
{
  for var in TS_LANE_PASSWORD TS_TRANSPORT_HOST_A_PASSWORD TS_TRANSPORT_HOST_B_PASSWORD \
             TS_TRANSPORT_OUTSIDE_PASSWORD \
             TS_BROKER_PASSWORD TS_SCHEDULER_PASSWORD TS_CLI_PASSWORD TS_ADMIN_PASSWORD \
             TS_OBSERVER_PASSWORD TS_REVOKER_PASSWORD; do
    echo "$var=$(secret)"
  done
  echo "NATS_CONFIG=$work/nats-server.conf"
  echo "TURNSTILE_ENV_FILE=$work/env"
  echo "TURNSTILE_REPLICAS=3"
  echo "NATS_SERVERS=nats:4222,nats-2:4222,nats-3:4222"
  echo "TS_AUTH_ISSUER=$("$bin/turnstile" admin issuer --seed-file "$work/issuer.nk")"
  echo "TURNSTILE_ISSUER_SEED=$work/issuer.nk"
  echo "NATS_PORT=${TEST_NATS_PORT:-14222}"
  echo "NATS_MONITOR_PORT=${TEST_NATS_MONITOR_PORT:-18222}"
  echo "NATS_IMAGE=turnstile-nats:local"
  echo "TURNSTILE_IMAGE=turnstile:local"
} > "$work/env"
chmod 0644 "$work/issuer.nk"   # read by the broker's (non-root) user inside its container

# Every container with a healthcheck turns healthy (bounded).
wait_healthy() {
  local deadline=$((SECONDS + 180)) unhealthy c state
  while :; do
    unhealthy=""
    for c in $(compose ps -q); do
      state="$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$c")"
      case "$state" in
        healthy|none) ;;
        *) unhealthy="$unhealthy $(docker inspect -f '{{.Name}}' "$c"):$state" ;;
      esac
    done
    [ -z "$unhealthy" ] && return 0
    if [ "$SECONDS" -gt "$deadline" ]; then
      echo "test-compose: not healthy within 180 s:$unhealthy" >&2
      exit 1
    fi
    sleep 2
  done
}

compose up -d --no-build
stage="every healthcheck healthy"
wait_healthy
echo "test-compose: every healthcheck healthy"

stage="three copies of every stream"
# Every stream and bucket has three copies, on three servers (nats-server's /jsz).
monitor="$(sed -n 's/^NATS_MONITOR_PORT=//p' "$work/env")"
python3 - "$monitor" <<'PY'
import json, sys, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/jsz?accounts=true&streams=true&config=true"
jsz = json.load(urllib.request.urlopen(url, timeout=5))
streams = [s for a in jsz.get("account_details", []) for s in a.get("stream_detail", [])]
names = sorted(s["name"] for s in streams)
short = [s["name"] for s in streams if s["config"].get("num_replicas") != 3]
peers = {s["name"]: 1 + len(s.get("cluster", {}).get("replicas", [])) for s in streams}
assert len(streams) == 16, f"expected 6 streams and 10 buckets, found {names}"
assert not short, f"not three copies: {short}"
assert all(n == 3 for n in peers.values()), f"copies placed: {peers}"
print(f"test-compose: {len(streams)} streams and buckets, three copies each")
PY

cli() { compose run --rm -T cli "$@"; }
# A read the stage needs an answer to, retried for up to 120 s: after a partition heals or a
# restart, a node can answer "no stream found" until it has caught up with the cluster (seen
# for about 50 s), and one timed-out request must not decide the stage.
cli_read() {
  local deadline=$((SECONDS + 120)) out
  until out="$(cli "$@")"; do
    if [ "$SECONDS" -gt "$deadline" ]; then
      echo "test-compose: \`turnstile $*\` did not answer within 120 s" >&2
      return 1
    fi
    sleep 2
  done
  printf '%s\n' "$out"
}
stage="a scheduled run completes"
session="$(cli session create --agent mock --name compose-demo | tr -d '\r')"
echo "test-compose: session $session"
cli schedule add --name compose-every-5s --cron '*/5 * * * * *' --tz UTC \
  --session "$session" --message '!reply scheduled hello' >/dev/null
deadline=$((SECONDS + 120))
until cli run list --schedule compose-every-5s --json | grep -q '"completed"'; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: no scheduled run completed within 120 s" >&2
    cli run list --schedule compose-every-5s >&2 || true
    exit 1
  fi
  sleep 2
done
echo "test-compose: a scheduled run of the mock agent completed"

stage="every service's metrics"
# /metrics on the same :8080 as the healthchecks (docs/operate.md): after the scheduled run,
# the scheduler has fired slots and some session-lane replica has started turns.
metrics_of() {
  local c
  for c in $(compose ps -q "$1"); do
    docker exec "$c" bash -c 'exec 3<>/dev/tcp/127.0.0.1/8080 &&
      printf "GET /metrics HTTP/1.0\r\n\r\n" >&3 && timeout 5 cat <&3'
  done
}
for svc in session-lane notification-broker scheduler transport-host-a; do
  exposed="$(metrics_of "$svc" || true)"
  if ! grep -q '^# EOF' <<<"$exposed"; then
    echo "test-compose: $svc serves no metrics on :8080/metrics" >&2
    exit 1
  fi
  case "$svc" in
    scheduler) want='^turnstile_slots_total\{outcome="fired"\} [1-9]' ;;
    session-lane) want='^turnstile_turns_started_total\{kind="run"\} [1-9]' ;;
    *) want='^# EOF' ;;
  esac
  if ! grep -Eq "$want" <<<"$exposed"; then
    echo "test-compose: $svc's metrics lack $want" >&2
    printf '%s\n' "$exposed" >&2
    exit 1
  fi
done
echo "test-compose: every service serves its metrics; slots fired and run turns started are counted"

stage="a transport agent outside compose"
# A host outside compose joins through the published port, started the way the shipped systemd
# unit starts it: its ExecStart with an environment file holding its own host's credentials.
unit=deploy/turnstile-transport-agent.service
exec_start="$(sed -n 's/^ExecStart=//p' "$unit")"
binary="$bin/$(basename "$exec_start")"
outside_data="$work/outside"
mkdir -p "$outside_data"
password="$(sed -n 's/^TS_TRANSPORT_OUTSIDE_PASSWORD=//p' "$work/env")"
port="$(sed -n 's/^NATS_PORT=//p' "$work/env")"
cat > "$work/transport-agent.env" <<ENV
TURNSTILE_NATS_URL=nats://transport-outside:$password@127.0.0.1:$port
TURNSTILE_HOST=outside
TURNSTILE_DATA_DIR=$outside_data
TURNSTILE_AGENT_BIN=$PWD/$bin/turnstile
ENV
( set -a; . "$work/transport-agent.env"; set +a; exec "$binary" ) \
  > "$work/outside.log" 2>&1 &
outside_pid=$!
export TURNSTILE_NATS_URL="nats://cli:$(sed -n 's/^TS_CLI_PASSWORD=//p' "$work/env")@127.0.0.1:$port"
deadline=$((SECONDS + 60))
until outside="$("$bin/turnstile" session create --agent mock --name outside \
                   --host outside 2>/dev/null)"; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: the host outside compose never joined" >&2
    tail -30 "$work/outside.log" >&2
    exit 1
  fi
  sleep 1
done
reply="$("$bin/turnstile" session send "$outside" '!reply hello from outside' --wait --timeout 60s)"
if ! printf '%s' "$reply" | grep -q 'hello from outside'; then
  echo "test-compose: the outside host's turn did not reply: $reply" >&2
  tail -30 "$work/outside.log" >&2
  exit 1
fi
echo "test-compose: a transport agent outside compose ran a turn"

stage="a session-lane replica killed"
# A session-lane replica container is SIGKILLed while it serves a turn: with the
# default 30 s pin TTL and ack wait, the survivor takes its lanes over within seconds: the turn
# in flight completes, typed once, and the session's next turn is served.
lanekill="$(cli session create --agent mock --name lanekill --host host-b | tr -d '\r')"
# The turn outlasts the take-over, so the survivor's resumption of it is what is timed.
first="$("$bin/turnstile" session send "$lanekill" $'lanekill-1\n!sleep 8s' | tr -d '\r')"
deadline=$((SECONDS + 60))
until serving="$("$bin/turnstile" events --session "$lanekill" --replay --no-follow --json 2>/dev/null \
                  | python3 -c '
import json, sys
for line in sys.stdin:
    e = json.loads(line)
    if e.get("type") == "turn.started":
        print(e["data"]["replica"])
        break
')" && [ -n "$serving" ]; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: the lanekill turn never started" >&2
    exit 1
  fi
  sleep 1
done
killed_at="$(date +%s.%N)"
docker kill "$serving" >/dev/null
echo "test-compose: killed session-lane replica $serving during a turn"
# Bounded by the ack wait (30 s) plus the turn: in one run of four the resumed turn's item came
# back only after the lane ack wait although the take-over had happened (see docs/deploy.md).
if ! "$bin/turnstile" session send "$lanekill" $'lanekill-2\n!reply served again' --wait \
     --timeout 60s > "$work/lanekill.out"; then
  echo "test-compose: the killed replica's session was not served within 60 s" >&2
  exit 1
fi
echo "test-compose: the killed replica's session took its next turn $(python3 -c "import sys,time; print(round((time.time() - float(sys.argv[1])) * 1000))" "$killed_at") ms after the kill (its turn in flight lasted 8 s)"
# The survivor's own account of the take-over (its log line names the dead instance), timed
# from the kill. (Not a `turn.started`: the survivor re-dispatches the turn in flight with the
# same ids, and the event stream drops the repeated event as a duplicate.)
served=""
deadline=$((SECONDS + 20))
while [ -z "$served" ] && [ "$SECONDS" -le "$deadline" ]; do
  served="$(for c in $(compose ps -q session-lane); do docker logs "$c" 2>&1; done \
    | grep "took over a dead replica's lanes instance=$serving-" \
    | head -1 | python3 -c '
import datetime, sys
killed = float(sys.argv[1])
for line in sys.stdin:
    at = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")[:26] + "+00:00")
    print(round((at.timestamp() - killed) * 1000))
' "$killed_at")"
  [ -n "$served" ] || sleep 1
done
echo "test-compose: another replica took the killed replica's lanes over ${served:-?} ms after the kill"
# How it knew: the server said the killed replica's connection was gone (the fast path), or
# the replica was silent past its timeout.
for c in $(compose ps -q session-lane); do docker logs "$c" 2>&1; done \
  | grep "claimed a dead replica instance=$serving-" | head -1 \
  | sed 's/^/test-compose: survivor: /' || true
if [ -z "$served" ] || [ "$served" -gt 10000 ]; then
  echo "test-compose: no take-over within 10 s (pin TTL 30 s)" >&2
  exit 1
fi
transcript="$(docker exec "$(compose ps -q transport-host-b)" sh -c 'cat /var/lib/turnstile/mock-agent/*.jsonl')"
for m in lanekill-1 lanekill-2; do
  n="$(printf '%s\n' "$transcript" | grep -c "$m" || true)"
  if [ "$n" != 1 ]; then
    echo "test-compose: $m was typed $n times" >&2
    exit 1
  fi
done
docker start "$serving" >/dev/null

# A run of four messages `<prefix>-m1..4` on host-a, two of them starting steps: every message
# was typed exactly once, and each step's result handed over exactly once, whatever its end (a
# step cut off with its host's connection ends `failed`, and that result is handed over too).
# A delivery lists each result as `- <name> [<status>] <id>: <summary>`.
once_each() {
  local prefix="$1" transcript n m s
  shift
  # `--unless-unstarted`: a step the agent could not start at all (its start call failed
  # while a node was cut off, and the agent was told so) has no result to hand over; one
  # that was queued (a `step.queued` event names it) must be handed over exactly once.
  local unstarted=""
  if [ "${1:-}" = --unless-unstarted ]; then unstarted=1; shift; fi
  transcript="$(docker exec "$(compose ps -q transport-host-a)" \
    sh -c 'cat /var/lib/turnstile/mock-agent/*.jsonl')"
  for m in "$prefix-m1" "$prefix-m2" "$prefix-m3" "$prefix-m4"; do
    n="$(printf '%s\n' "$transcript" | grep -c "$m" || true)"
    if [ "$n" != 1 ]; then
      echo "test-compose: $m was typed $n times" >&2
      exit 1
    fi
  done
  for s in "$@"; do
    n="$( (printf '%s\n' "$transcript" | grep -oE -- "- $s \[[a-z_]+\]" || true) | wc -l)"
    if [ "$n" = 0 ] && [ -n "$unstarted" ] && ! "$bin/turnstile" events --session "$inside" \
         --replay --no-follow --json | python3 -c '
import json, sys
name = sys.argv[1]
sys.exit(0 if any(e.get("type") == "step.queued" and e.get("data", {}).get("name") == name
                  for e in map(json.loads, sys.stdin)) else 1)
' "$s"; then
      echo "test-compose: step $s never started (its start failed during the cut; the agent was told): no result to hand over"
      continue
    fi
    if [ "$n" != 1 ]; then
      echo "test-compose: step $s's result was handed over $n times" >&2
      printf '%s\n' "$transcript" >&2
      exit 1
    fi
  done
}

# Every stream's leader reports both other copies current (only a leader knows; each node's
# /jsz is read through its address on the compose network, reachable from the Docker host).
jsz_current() {
  local addrs=""
  for n in nats nats-2 nats-3; do
    addrs="$addrs $(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' \
      "$(compose ps -q "$n")")"
  done
  python3 - $addrs <<'PY'
import json, sys, urllib.request
views = {}
for ip in sys.argv[1:]:
    try:
        get = lambda path: json.load(urllib.request.urlopen(f"http://{ip}:8222/{path}", timeout=5))
        views[get("varz")["server_name"]] = get("jsz?accounts=true&streams=true")
    except Exception:
        continue
ok, lane = True, ""
names = set()
for server, j in views.items():
    for a in j.get("account_details", []):
        for s in a.get("stream_detail", []):
            names.add(s["name"])
leaders = {}
for server, j in views.items():
    for a in j.get("account_details", []):
        for s in a.get("stream_detail", []):
            c = s.get("cluster", {})
            if c.get("leader") == server:
                reps = c.get("replicas", [])
                leaders[s["name"]] = len(reps) == 2 and all(r.get("current") for r in reps)
                if s["name"] == "TS_LANES":
                    lane = server
ok = names and all(leaders.get(n) for n in names)
print(lane if ok else "")
PY
}
# Waits (bounded) until every stream's copies are current; prints the lane stream's leader.
lane_leader() {
  local leader deadline=$((SECONDS + 120))
  until leader="$(jsz_current 2>/dev/null)" && [ -n "$leader" ]; do
    if [ "$SECONDS" -gt "$deadline" ]; then
      echo "test-compose: the cluster did not have every copy current within 120 s" >&2
      exit 1
    fi
    sleep 2
  done
  echo "$leader"
}

# A run of four messages `<prefix>-m1..4` on the host-a session, two starting steps
# `<step1>`/`<step2>`, in the background (its output in $work/<prefix>.out), bounded: it takes
# about 10 s, and a wait that never ends would hang the suite.
start_run() {
  local prefix="$1" step1="$2" step2="$3"
  "$bin/turnstile" run start --session "$inside" --wait \
    --message "$prefix-m1"$'\n'"!step $step1 1s --scope run" --message "$prefix-m2"$'\n!sleep 2s' \
    --message "$prefix-m3"$'\n'"!step $step2 1s --scope run" --message "$prefix-m4"$'\n!sleep 1s' \
    > "$work/$prefix.out" 2>&1 &
  run_pid=$!
  ( sleep 300; kill "$run_pid" 2>/dev/null ) &
  run_guard=$!
}

# Waits for the run of start_run; fails with `<what>` and its output unless it completed.
finish_run() {
  local prefix="$1" what="$2" status=0
  wait "$run_pid" || status=$?
  kill "$run_guard" 2>/dev/null || true
  if [ "$status" -ne 0 ]; then
    echo "test-compose: the run did not complete $what:" >&2
    cat "$work/$prefix.out" >&2
    exit 1
  fi
}

stage="the lane stream leader killed mid-run"
# The nats node leading the lane stream is killed mid-run: the run completes,
# each message is typed exactly once, and each step's result is handed over exactly once. On a
# host inside compose, whose agents have every node as a seed.
inside="$(cli session create --agent mock --name failover --host host-a | tr -d '\r')"
leader="$(lane_leader)"
start_run failover fa fb
sleep 2
case "$leader" in
  turnstile-nats) node=nats ;;
  *) node="$leader" ;;
esac
docker kill "$(compose ps -q "$node")" >/dev/null
echo "test-compose: killed $node, the lane stream's leader, mid-run"
finish_run failover "after its leader was killed"
once_each failover fa fb
echo "test-compose: the run completed after its leader was killed: every message typed once, each step's result handed over once"
docker start "$(compose ps -q "$node")" >/dev/null

stage="a nats node cut off for 20 s"
# One nats node is cut off from the network for 20 s mid-run, then reconnected:
# the same holds. The node cut off is the one holding host-a's transport connection (the
# transport must notice, move to another seed and heartbeat there inside the 15 s host TTL),
# else the one leading the lane stream, once every stream has its three copies current again
# after the restart above. Never `nats`: it carries the published ports this script's own
# clients connect through.
network="$(docker inspect -f '{{range $k, $v := .NetworkSettings.Networks}}{{$k}}{{end}}' \
  "$(compose ps -q nats-2)")"
leader="$(lane_leader)"
transport_node="$(for n in nats nats-2 nats-3; do
  ip="$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$(compose ps -q "$n")")"
  python3 - "$ip" "$n" <<'PY'
import json, sys, urllib.request
connz = json.load(urllib.request.urlopen(f"http://{sys.argv[1]}:8222/connz?limit=10000", timeout=5))
if any(c.get("name") == "transport-host-a" for c in connz.get("connections", [])):
    print(sys.argv[2])
PY
done)"
case "$leader" in
  turnstile-nats) leader_node=nats ;;
  *) leader_node="$leader" ;;
esac
node=""
for n in "$transport_node" "$leader_node" nats-2; do
  case "$n" in nats-2|nats-3) node="$n"; break ;; esac
done
start_run partition pa pb
sleep 2
container="$(compose ps -q "$node")"
docker network disconnect "$network" "$container"
echo "test-compose: cut $node off the network for 20 s (host-a's transport was on ${transport_node:-?}, the lane stream's leader was $leader_node)"
sleep 20
docker network connect --alias "$node" "$network" "$container"
echo "test-compose: reconnected $node"
finish_run partition "across the partition"
once_each partition --unless-unstarted pa pb
echo "test-compose: the run completed across the partition: every message typed once, each started step's result handed over once"

# The cut-off node catches up before the next stage (a client's new watch could otherwise be
# placed on a node still out of step), and every service is serving again: a session-lane
# replica whose liveness renewals failed while the replicas bucket's stream moved is taken for
# dead and stops, fenced, for compose to start again (seen once: the next stage's first call
# then went unanswered for 9 s). And writes are served again: after the partition ends the
# nodes re-form their routes, and nats-server can flood them with duplicate route connections
# for over a minute (tens of thousands, "Duplicate Route" in its log; a known nats-server
# defect), during which a call can go unanswered (seen in `scripts/test.sh`: the next stage's
# `session create` timed out). A probe session is created until one is, bounded.
lane_leader >/dev/null
wait_healthy
writes_served() {
  local deadline=$((SECONDS + 180)) started=$SECONDS probes=0
  until cli session create --agent mock --name "probe-$probes" --host host-b >/dev/null; do
    probes=$((probes + 1))
    if [ "$SECONDS" -gt "$deadline" ]; then
      echo "test-compose: no session could be created within 180 s after the partition" >&2
      exit 1
    fi
    sleep 2
  done
  if [ "$probes" -gt 0 ]; then
    echo "test-compose: NOTE: writes were served again $((SECONDS - started)) s after the partition's stage ($probes probe(s) unanswered)" >&2
  fi
}
writes_served

stage="a transport host container killed"
# A transport host container is killed: the turn it was running fails
# `transport_unavailable` with evidence, the other host's sessions are untouched, and after
# `docker start` its session resumes its conversation.
other="$(cli session create --agent mock --name other-host --host host-b | tr -d '\r')"
long="$("$bin/turnstile" session send "$inside" $'hostkill-long\n!sleep 60s' | tr -d '\r')"
case "$long" in
  trn_*) ;;
  *) echo "test-compose: session send printed no turn id: $long" >&2; exit 1 ;;
esac
host_a="$(compose ps -q transport-host-a)"
# Killed once the agent has the message (a lane still pinned to a replica fenced by the
# partition stage takes up to the pin TTL to pass it on; a fixed pause raced that).
deadline=$((SECONDS + 60))
until docker exec "$host_a" sh -c 'cat /var/lib/turnstile/mock-agent/*.jsonl 2>/dev/null' \
        | grep -q hostkill-long; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: the turn to kill the host under was not typed within 60 s" >&2
    exit 1
  fi
  sleep 0.5
done
docker kill "$host_a" >/dev/null
echo "test-compose: killed transport-host-a during a turn"
if ! "$bin/turnstile" session send "$other" '!reply host-b untouched' --wait --timeout 60s \
     > "$work/other.out"; then
  echo "test-compose: host-b's session was disturbed: $(cat "$work/other.out")" >&2
  exit 1
fi
deadline=$((SECONDS + 90))
until "$bin/turnstile" events --session "$inside" --replay --no-follow --json \
        | grep "$long" | grep -q transport_unavailable; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: the killed host's turn did not fail transport_unavailable" >&2
    "$bin/turnstile" events --session "$inside" --replay --no-follow >&2 || true
    exit 1
  fi
  sleep 2
done
echo "test-compose: its turn failed transport_unavailable; host-b's session went on"
docker start "$host_a" >/dev/null
if ! "$bin/turnstile" session send "$inside" $'hostkill-after\n!reply resumed' --wait \
     --timeout 120s > "$work/resumed.out"; then
  echo "test-compose: the session did not come back: $(cat "$work/resumed.out")" >&2
  exit 1
fi
# The same conversation goes on: the earlier messages and the new one share its transcript.
resumed="$(docker exec "$host_a" sh -c 'grep -l hostkill-after /var/lib/turnstile/mock-agent/*.jsonl | xargs cat')"
for m in failover-m1 hostkill-long hostkill-after; do
  if ! printf '%s\n' "$resumed" | grep -q "$m"; then
    echo "test-compose: the resumed conversation lacks $m" >&2
    exit 1
  fi
done
echo "test-compose: after docker start the session resumed its conversation"

stage="down and up again"
# Down and up again with the volumes kept. Before `down`: a session on host-b
# has a step's completion pending (the step ended while the session's lane was busy with a
# long turn, so it was not handed over yet), and the run records are read. After `up`: every
# session, the schedule and every run record are there as they were, the pending completion
# is handed over exactly once, and a slot of the schedule that falls after `up` fires and its
# run completes.
pending="$(cli session create --agent mock --name pending --host host-b | tr -d '\r')"
"$bin/turnstile" session send "$pending" $'pend-1\n!step pstep 2s --scope detached' --wait \
  --timeout 60s > "$work/pend-1.out"
"$bin/turnstile" session send "$pending" $'pend-2\n!sleep 600s' > "$work/pend-2.out"
deadline=$((SECONDS + 60))
until "$bin/turnstile" events --session "$pending" --replay --no-follow --json \
        | grep '"step.completed"' | grep -q pstep; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: step pstep did not complete within 60 s" >&2
    "$bin/turnstile" events --session "$pending" --replay --no-follow >&2 || true
    exit 1
  fi
  sleep 1
done
host_b_transcripts() {
  docker exec "$(compose ps -q transport-host-b)" sh -c 'cat /var/lib/turnstile/mock-agent/*.jsonl'
}
if host_b_transcripts | grep -q -- "- pstep \["; then
  echo "test-compose: pstep's completion was handed over while its session was busy" >&2
  # What the session did, in order (pend-2's outcome among it), and what the agent was typed.
  "$bin/turnstile" events --session "$pending" --replay --no-follow >&2 || true
  host_b_transcripts >&2 || true
  exit 1
fi
echo "test-compose: step pstep completed while its session is busy: its completion is pending"
runs_before="$(cli_read run list --limit 1000 --json | tr -d '\r')"
compose down >/dev/null 2>&1
up_at="$(date -u +%Y-%m-%dT%H:%M:%S)"
compose up -d --no-build >/dev/null 2>&1
deadline=$((SECONDS + 180))
until [ "$(compose ps -q | xargs docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}healthy{{end}}' | sort -u)" = healthy ]; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: not healthy again within 180 s after down/up" >&2
    exit 1
  fi
  sleep 2
done
# Every session, the schedule and every run recorded before `down` are there, and every run
# that had ended has the same outcome. A node still catching up after the restart can answer
# from behind for a few seconds: a check that fails is read again for up to 60 s (what was
# lost stays lost), and a disagreement that went away is still printed.
printf '%s' "$runs_before" > "$work/runs-before.json"
records_kept() {
  local sessions s
  sessions="$(cli_read session list)" || return 1
  for s in "$session" "$inside" "$other" "$pending"; do
    if ! printf '%s\n' "$sessions" | grep -q "$s"; then
      echo "test-compose: session $s is gone after down/up" >&2
      return 1
    fi
  done
  cli_read schedule show compose-every-5s >/dev/null || return 1
  cli_read run list --limit 1000 --json | tr -d '\r' > "$work/runs-after.json" || return 1
  python3 - "$work/runs-before.json" "$work/runs-after.json" <<'PY'
import json, sys
before = {r["id"]: r for r in json.load(open(sys.argv[1]))["items"]}
after = {r["id"]: r for r in json.load(open(sys.argv[2]))["items"]}
gone = sorted(set(before) - set(after))
ended = ("completed", "failed", "cancelled")
changed = [(i, r["status"], after[i]["status"]) for i, r in before.items()
           if i in after and r["status"] in ended and after[i]["status"] != r["status"]]
if gone or changed:
    print(f"test-compose: after down/up, runs gone: {gone}; ended runs whose outcome changed "
          f"(before, after): {changed}", file=sys.stderr)
    sys.exit(1)
print(f"test-compose: all {len(before)} run records are there after down/up, the ended ones unchanged")
PY
}
deadline=$((SECONDS + 60))
until records_kept; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: records still missing or changed 60 s after down/up" >&2
    exit 1
  fi
  echo "test-compose: NOTE: a read right after down/up disagreed (above); reading again" >&2
  sleep 3
done
# The pending completion is handed over exactly once, in the session's resumed conversation.
deadline=$((SECONDS + 180))
until [ "$(host_b_transcripts | grep -oE -- "- pstep \[[a-z_]+\]" | wc -l)" -ge 1 ]; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: pstep's pending completion was not handed over within 180 s after up" >&2
    "$bin/turnstile" events --session "$pending" --replay --no-follow >&2 || true
    exit 1
  fi
  sleep 2
done
transcript="$(host_b_transcripts)"
for pattern in "- pstep \[completed\]" "pend-1" "pend-2"; do
  n="$(printf '%s\n' "$transcript" | grep -cE -- "$pattern" || true)"
  if [ "$n" != 1 ]; then
    echo "test-compose: '$pattern' appears $n times in host-b's transcripts" >&2
    exit 1
  fi
done
echo "test-compose: the pending completion was handed over once after down/up"
# A slot after `up` fires and its run completes.
deadline=$((SECONDS + 180))
until cli run list --schedule compose-every-5s --limit 1000 --json | tr -d '\r' | python3 -c '
import json, sys
after = sys.argv[1]
runs = json.load(sys.stdin)["items"]
sys.exit(0 if any(r["status"] == "completed" and r["created_at"][:19] > after for r in runs) else 1)
' "$up_at"; do
  if [ "$SECONDS" -gt "$deadline" ]; then
    echo "test-compose: no slot of compose-every-5s fired and completed within 180 s after up" >&2
    cli run list --schedule compose-every-5s >&2 || true
    exit 1
  fi
  sleep 2
done
echo "test-compose: after down/up every session, the schedule and every run record are there, the pending completion was handed over once, and the next slot fired"
