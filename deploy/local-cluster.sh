#!/usr/bin/env bash
# A local multi-replica apsup cluster on this machine: N background + M api replicas of
# `apsup run` against one MySQL-compatible database (OceanBase mode), with short leases.
#
#   deploy/local-cluster.sh [--url URL] [--background N] [--api M] [--app MODULE]...
#                           [--mode global|dedicated] [--base-port P] [--seconds S]
#
# Without --url (or APSUP_DB_URL) it starts a throwaway seekdb (OceanBase 4.3.5, MySQL mode,
# from the PyPI package pylibseekdb) on 127.0.0.1 and creates the database. It migrates the
# schema, starts the replicas (logs and pids under var/local-cluster/), waits until each one
# answers /healthz, prints the endpoints, and runs until Ctrl-C (or --seconds), then stops
# every replica (SIGTERM, confirmed) and the server it started. With --seconds it then checks
# every replica once more and exits 1 if one is not ready or reports a degraded family.
#
# Replica i listens on P + 10*i (dedicated mode also uses the next ports, one per family);
# --base-port 0 picks free ports (global mode).
# Environment: APSUP_PYTHON (default .venv/bin/python; any interpreter with apsup[mysql]
# installed), POWERCONTEXT_SERVER_RUNTIME_* are passed through (e.g. family settings);
# lease/renew/poll default to 3/1/0.5 s here; APSUP_CLUSTER_STATE: the state folder (default
# var/local-cluster; a second cluster needs its own). --app modules are imported as `apsup run` does:
# installed, on PYTHONPATH, or in the current directory. The reference families (the default
# app, apsup.families.*) get their tables: the migration adds --with-reference-families.
# tests/replicas/ mirrors this layout in Python for the fault tests.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${APSUP_PYTHON:-$ROOT/.venv/bin/python}
URL=${APSUP_DB_URL:-}
BACKGROUND=3
API=1
MODE=global
BASE_PORT=9200
SECONDS_TO_RUN=0
APPS=()

die() { echo "local-cluster: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case $1 in
        --url) URL=$2; shift 2 ;;
        --background) BACKGROUND=$2; shift 2 ;;
        --api) API=$2; shift 2 ;;
        --app) APPS+=("$2"); shift 2 ;;
        --mode) MODE=$2; shift 2 ;;
        --base-port) BASE_PORT=$2; shift 2 ;;
        --seconds) SECONDS_TO_RUN=$2; shift 2 ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ ${#APPS[@]} -gt 0 ] || APPS=(apsup.families.topic_memory)
[ -x "$PY" ] || die "no python at $PY (run ./run setup, or set APSUP_PYTHON)"
case $MODE in global | dedicated) ;; *) die "--mode must be global or dedicated" ;; esac

STATE=${APSUP_CLUSTER_STATE:-$ROOT/var/local-cluster}
mkdir -p "$STATE"
# Another cluster's replicas still running from this state folder: their logs, pids and the
# DSN hint would be overwritten under them.
for pidfile in "$STATE"/*.pid; do
    [ -e "$pidfile" ] || continue
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
        tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "apsup.cli run"; then
        die "a local cluster already runs from $STATE (pid $pid, $(basename "$pidfile" .pid)); stop it, or set APSUP_CLUSTER_STATE to another folder"
    fi
done
PIDS=()
NAMES=()
SERVER_PID=
SERVER_DIR=
SLEEP_PID=

APP_ARGS=()
for app in "${APPS[@]}"; do APP_ARGS+=(--app "$app"); done

stop_all() {
    local i pid
    trap - EXIT INT TERM
    [ -z "$SLEEP_PID" ] || kill "$SLEEP_PID" 2>/dev/null || true
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for i in "${!PIDS[@]}"; do
        pid=${PIDS[$i]}
        # Replicas are our children: wait confirms their exit (they stop Workers, release Leases).
        if ! timeout 45 tail --pid="$pid" -f /dev/null 2>/dev/null; then
            echo "local-cluster: ${NAMES[$i]} did not stop in 45 s; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    if [ -n "$SERVER_PID" ]; then
        # seekdb exits 137 on SIGTERM: poll instead of waiting under set -e.
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        rm -rf "$SERVER_DIR"
    fi
    echo "local-cluster: stopped"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_seekdb() {
    local bin port
    bin=$("$PY" -c 'import os, pylibseekdb; print(os.path.join(os.path.dirname(pylibseekdb.__file__), "seekdb"))') ||
        die "pylibseekdb is not installed (pip install pylibseekdb==1.4.0.post1), or pass --url"
    port=$(free_port)
    SERVER_DIR=$STATE/seekdb-$port
    rm -rf "$SERVER_DIR"
    mkdir -p "$SERVER_DIR"
    # time_zone=+00:00 is fixed when the data folder is created: apsup reads database time as UTC.
    TELEMETRY_ENABLED=false "$bin" --nodaemon --port "$port" --base-dir "$SERVER_DIR" \
        --log-level WARN --variable time_zone=+00:00 </dev/null >"$SERVER_DIR/console.out" 2>&1 &
    SERVER_PID=$!
    disown "$SERVER_PID" # no job report when it exits 137 on SIGTERM
    local password
    password=$("$PY" - "$port" "$SERVER_PID" <<'PYEOF'
import os, secrets, sys, time
import pymysql
port, pid = int(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    os.kill(pid, 0)
    try:
        conn = pymysql.connect(host="127.0.0.1", port=port, user="root", connect_timeout=2)
    except pymysql.err.MySQLError:
        time.sleep(0.1)
        continue
    password = secrets.token_hex(16)
    with conn.cursor() as cur:
        cur.execute("CREATE DATABASE IF NOT EXISTS apsup")
        cur.execute("ALTER USER root IDENTIFIED BY %s", (password,))
    conn.close()
    print(password)
    sys.exit(0)
sys.exit(1)
PYEOF
    ) || die "seekdb did not start (see $SERVER_DIR/console.out)"
    # It listens on 0.0.0.0 whatever we ask; we only ever connect through 127.0.0.1, and root
    # gets a random password as soon as it accepts connections (it starts with none).
    URL="mysql+pymysql://root:$password@127.0.0.1:$port/apsup"
    echo "local-cluster: seekdb on 127.0.0.1:$port (data in $SERVER_DIR)"
}

[ -n "$URL" ] || start_seekdb

export POWERCONTEXT_SERVER_RUNTIME_DATABASE_URL=$URL
# The DSN (with its password) for the hint below, readable by this user only.
(umask 077 && printf '%s\n' "$URL" >"$STATE/db-url")
export POWERCONTEXT_SERVER_RUNTIME_ARTIFACT_PROCESSING_SUPERVISOR_MODE=$MODE
export POWERCONTEXT_SERVER_RUNTIME_LEASE_SECONDS=${POWERCONTEXT_SERVER_RUNTIME_LEASE_SECONDS:-3}
export POWERCONTEXT_SERVER_RUNTIME_RENEW_SECONDS=${POWERCONTEXT_SERVER_RUNTIME_RENEW_SECONDS:-1}
export POWERCONTEXT_SERVER_RUNTIME_POLL_SECONDS=${POWERCONTEXT_SERVER_RUNTIME_POLL_SECONDS:-0.5}
export POWERCONTEXT_SERVER_RUNTIME_HTTP_HOST=127.0.0.1
export POWERCONTEXT_SERVER_RUNTIME_LOG_FORMAT=${POWERCONTEXT_SERVER_RUNTIME_LOG_FORMAT:-json}

MIGRATE_ARGS=()
for app in "${APPS[@]}"; do
    case $app in apsup.families | apsup.families.*) MIGRATE_ARGS=(--with-reference-families) ;; esac
done
echo "local-cluster: migrating ${MIGRATE_ARGS[*]}"
"$PY" -m apsup.cli migrate "${MIGRATE_ARGS[@]}" >"$STATE/migrate.log" 2>&1 ||
    { cat "$STATE/migrate.log" >&2; die "migration failed"; }

start_replica() { # name role index
    local name=$1 role=$2 index=$3 port
    if [ "$BASE_PORT" = 0 ]; then
        port=$(free_port) # --base-port 0: any free port (global mode; tests)
    else
        port=$((BASE_PORT + 10 * index))
    fi
    POWERCONTEXT_SERVER_RUNTIME_ARTIFACT_PROCESSING_ROLE=$role \
        POWERCONTEXT_SERVER_RUNTIME_HTTP_PORT=$port \
        "$PY" -m apsup.cli run "${APP_ARGS[@]}" </dev/null >"$STATE/$name.log" 2>&1 &
    PIDS+=($!)
    NAMES+=("$name")
    echo "$!" >"$STATE/$name.pid"
    echo "$port" >"$STATE/$name.port"
}

index=0
for ((i = 1; i <= BACKGROUND; i++)); do start_replica "background-$i" background "$index"; index=$((index + 1)); done
for ((i = 1; i <= API; i++)); do start_replica "api-$i" api "$index"; index=$((index + 1)); done

echo "local-cluster: waiting for ${#PIDS[@]} replicas"
"$PY" - "$STATE" "${NAMES[@]}" <<'PYEOF' || die "a replica did not become healthy (logs in $STATE)"
import json, sys, time, urllib.request
state, names = sys.argv[1], sys.argv[2:]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
deadline = time.monotonic() + 90
for name in names:
    port = open(f"{state}/{name}.port").read().strip()
    while True:
        try:
            with opener.open(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
                body = json.loads(resp.read())
            break
        except Exception:
            if time.monotonic() > deadline:
                sys.exit(f"{name} (port {port}) not ready; see {state}/{name}.log")
            time.sleep(0.2)
    sups = ", ".join(f"{s['key']}={'leader' if s['leader'] else 'standby'}" for s in body["supervisors"])
    print(f"  {name:<14} http://127.0.0.1:{port}  {body['status']:<8} {sups}")
PYEOF

echo "local-cluster: running (mode $MODE); /healthz /readyz /metrics /status on each port."
echo "local-cluster: trigger work with:" \
    "$PY -m apsup.cli trigger FAMILY SCOPE ${APP_ARGS[*]} --db \"\$(cat $STATE/db-url)\""
echo "local-cluster: watch it with: $PY -m apsup.cli status --db \"\$(cat $STATE/db-url)\""
# Sleep in the background and wait for it: bash runs a trap only between foreground commands,
# so a foreground sleep would leave SIGTERM unanswered until it ended.
if [ "$SECONDS_TO_RUN" != 0 ]; then
    sleep "$SECONDS_TO_RUN" &
    SLEEP_PID=$!
    wait "$SLEEP_PID"
    "$PY" - "$STATE" "${NAMES[@]}" <<'PYEOF' || die "a replica is not healthy after ${SECONDS_TO_RUN}s (logs in $STATE)"
import json, sys, urllib.error, urllib.request
state, names = sys.argv[1], sys.argv[2:]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
bad = []
for name in names:
    port = open(f"{state}/{name}.port").read().strip()
    try:
        with opener.open(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    except Exception as exc:
        bad.append(f"{name}: /readyz unreachable ({exc})")
        continue
    degraded = {f: v["reason"] for f, v in body.get("families", {}).items() if v["status"] == "degraded"}
    if body["status"] not in ("ok", "standby") or degraded:
        bad.append(f"{name}: {body['status']} ({body.get('reason')}) {degraded or ''}")
for line in bad:
    print(f"local-cluster: {line}", file=sys.stderr)
print(f"local-cluster: {len(names) - len(bad)} of {len(names)} replicas ready, no family degraded" if not bad else "")
sys.exit(1 if bad else 0)
PYEOF
else
    echo "local-cluster: Ctrl-C (or SIGTERM) to stop"
    while :; do
        sleep 3600 &
        SLEEP_PID=$!
        wait "$SLEEP_PID"
    done
fi
