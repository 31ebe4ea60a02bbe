#!/usr/bin/env bash
# Installs and starts the peers' servers for benchmarks/peers/compare.py, on 127.0.0.1 only:
#
#   - Redis (Debian's redis-server), port ${PEERS_REDIS_PORT:-6379}, append-only file with
#     `appendfsync everysec` (Redis's recommended durable setting: at most ~1 s of
#     acknowledged writes can be lost), broker for Celery and Dramatiq;
#   - PostgreSQL (Debian's postgresql), port ${PEERS_PG_PORT:-5432}, fsync and
#     synchronous_commit on (the defaults: each commit is flushed), for Procrastinate, with a
#     role and database `apsup_bench` (password `apsup_bench`).
#
# Needs root (apt-get). Idempotent: a package already installed is not reinstalled, a server
# already answering is left running, the role and database are created only when missing.
# CI does not run it. Then: `.venv/bin/pip install -e '.[bench]'`.
set -euo pipefail

REDIS_PORT=${PEERS_REDIS_PORT:-6379}
PG_PORT=${PEERS_PG_PORT:-5432}
REDIS_DIR=${PEERS_REDIS_DIR:-/var/lib/apsup-bench-redis}

die() { echo "setup.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (it installs redis-server and postgresql with apt-get)"

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v pg_ctlcluster >/dev/null 2>&1 || missing+=(postgresql)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup.sh: installing ${missing[*]} from Debian's packages" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# ---- Redis -------------------------------------------------------------------------------
if redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then
    echo "setup.sh: redis already answers on 127.0.0.1:$REDIS_PORT" >&2
else
    mkdir -p "$REDIS_DIR"
    chown redis:redis "$REDIS_DIR" 2>/dev/null || true
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --protected-mode yes \
        --dir "$REDIS_DIR" --appendonly yes --appendfsync everysec --save "" \
        --daemonize yes --pidfile "$REDIS_DIR/redis.pid" --logfile "$REDIS_DIR/redis.log"
    for _ in $(seq 50); do
        redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG && break
        sleep 0.1
    done
    redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping | grep -q PONG || die "redis did not start"
    echo "setup.sh: redis started on 127.0.0.1:$REDIS_PORT (appendfsync everysec)" >&2
fi

# ---- PostgreSQL --------------------------------------------------------------------------
PG_VERSION=$(pg_lsclusters -h | awk 'NR == 1 { print $1 }')
[ -n "$PG_VERSION" ] || die "no PostgreSQL cluster found (pg_lsclusters); reinstall postgresql"
PG_CLUSTER=$(pg_lsclusters -h | awk 'NR == 1 { print $2 }')
CONF=/etc/postgresql/$PG_VERSION/$PG_CLUSTER/conf.d/apsup-bench.conf
WANT="listen_addresses = '127.0.0.1'
port = $PG_PORT"
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$WANT" ]; then
    printf '%s\n' "$WANT" >"$CONF"
    if pg_lsclusters -h | awk 'NR == 1 { print $4 }' | grep -q online; then
        pg_ctlcluster "$PG_VERSION" "$PG_CLUSTER" restart
    fi
fi
if ! pg_lsclusters -h | awk 'NR == 1 { print $4 }' | grep -q online; then
    pg_ctlcluster "$PG_VERSION" "$PG_CLUSTER" start
fi
# Peer authentication over the socket: the postgres OS user is the superuser.
pg_sql() { su postgres -c "psql -p $PG_PORT -qAt -v ON_ERROR_STOP=1 -c \"$1\""; }
if [ "$(pg_sql "SELECT 1 FROM pg_roles WHERE rolname = 'apsup_bench'")" != 1 ]; then
    pg_sql "CREATE ROLE apsup_bench LOGIN PASSWORD 'apsup_bench'"
fi
if [ "$(pg_sql "SELECT 1 FROM pg_database WHERE datname = 'apsup_bench'")" != 1 ]; then
    pg_sql "CREATE DATABASE apsup_bench OWNER apsup_bench"
fi
echo "setup.sh: postgresql $PG_VERSION on 127.0.0.1:$PG_PORT, database apsup_bench ready" >&2
echo "redis://127.0.0.1:$REDIS_PORT/0"
echo "postgresql://apsup_bench:apsup_bench@127.0.0.1:$PG_PORT/apsup_bench"
