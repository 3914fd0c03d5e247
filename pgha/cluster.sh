#!/usr/bin/env bash
# Three PostgreSQL 15 nodes under Patroni, one etcd and HAProxy on this machine, for tests/pgha.
#
#   pgha/cluster.sh up [--sync]      install what is missing, start everything (idempotent);
#                                    --sync (or PGHA_SYNC=1): synchronous replication, else async
#   pgha/cluster.sh down             stop everything and remove the data
#   pgha/cluster.sh status           each member's role, state and lag; HAProxy's view
#   pgha/cluster.sh leader           the leader's node number (1, 2 or 3)
#   pgha/cluster.sh kill N           the whole node N dies: SIGKILL its Patroni and PostgreSQL
#   pgha/cluster.sh kill-leader      the same for the leader; prints its number
#   pgha/cluster.sh start N          start a dead node again; it rejoins as a replica
#   pgha/cluster.sh stop N | cont N  SIGSTOP / SIGCONT node N's PostgreSQL processes (a hung server)
#   pgha/cluster.sh switchover       patronictl switchover to a replica; prints the new leader
#   pgha/cluster.sh mode sync|async  switch the replication mode of the running cluster
#   pgha/cluster.sh pause-replication N | resume-replication N
#                                    SIGSTOP / SIGCONT node N's walreceiver (a replica falls behind)
#   pgha/cluster.sh walreceiver N    the pid of node N's walreceiver
#   pgha/cluster.sh wait-healthy [S] wait (S seconds, 60) for three members, one leader, replicas
#                                    streaming with no lag, and HAProxy routing to the leader
#
# Node N: PostgreSQL at 127.0.0.1:544N, Patroni's REST API at 8008+N (8009-8011). etcd at
# 127.0.0.1:2399 (peers 2400). HAProxy at 127.0.0.1:5440 routes to the primary only (Patroni's
# GET /primary), statistics at http://127.0.0.1:5449/. Everything lives in $PGHA_DIR
# (default /tmp/leases-pgha). Patroni and PostgreSQL run as user postgres; trust auth on
# 127.0.0.1, no flush per commit: a test rig, not a production layout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${PGHA_DIR:-/tmp/leases-pgha}
BIN_DIR=${PGHA_BIN_DIR:-/usr/lib/postgresql/15/bin}
DATABASES=${PGHA_DATABASES:-leases_pgha,leases_pgha_second}
RUN_AS=${PGHA_USER:-postgres}
PROXY_PORT=5440
STATS_PORT=5449
ETCD_PORT=2399
ETCD_PEER_PORT=2400
NODES=(1 2 3)

say() { printf 'pgha: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

pg_port() { echo $((5440 + $1)); }
rest_port() { echo $((8008 + $1)); }
node_dir() { echo "$DIR/node$1"; }

check_node() {
  case "${1:-}" in
    1|2|3) ;;
    *) die "which node? 1, 2 or 3, not '${1:-}'" ;;
  esac
}

install_packages() {
  local missing=()
  [ -x "$BIN_DIR/postgres" ] || missing+=(postgresql-15)
  command -v patroni >/dev/null || missing+=(patroni)
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v etcdctl >/dev/null || missing+=(etcd-client)
  command -v haproxy >/dev/null || missing+=(haproxy)
  command -v curl >/dev/null || missing+=(curl)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  id "$RUN_AS" >/dev/null 2>&1 || die "no user $RUN_AS to run PostgreSQL as (set PGHA_USER)"
}

fill() {  # fill TEMPLATE N SYNC: the template with this rig's values
  sed -e "s|@DIR@|$DIR|g" -e "s|@N@|$2|g" -e "s|@REST_PORT@|$(rest_port "${2:-0}")|g" \
      -e "s|@PG_PORT@|$(pg_port "${2:-0}")|g" -e "s|@ETCD_PORT@|$ETCD_PORT|g" -e "s|@BIN_DIR@|$BIN_DIR|g" \
      -e "s|@SYNC@|$3|g" -e "s|@PROXY_PORT@|$PROXY_PORT|g" -e "s|@STATS_PORT@|$STATS_PORT|g" "$1"
}

alive_as() {  # alive_as PIDFILE WORDS: the pid in PIDFILE if that process's command line has WORDS
  local pid
  [ -s "$1" ] || return 0
  pid=$(head -n 1 "$1")
  if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2"; then
    echo "$pid"
  fi
}

patroni_pid() { pgrep -u "$RUN_AS" -f "patroni $(node_dir "$1")/patroni.yml" || true; }
postmaster_pid() { alive_as "$(node_dir "$1")/data/postmaster.pid" "$(node_dir "$1")/data"; }
etcd_pid() { alive_as "$DIR/etcd.pid" "$DIR/etcd"; }
haproxy_pid() { alive_as "$DIR/haproxy.pid" "$DIR/haproxy.cfg"; }

postgres_pids() {  # the postmaster of node N and its children
  local pid
  pid=$(postmaster_pid "$1")
  [ -n "$pid" ] || return 0
  echo "$pid"
  pgrep -P "$pid" || true
}

wait_until() {  # wait_until SECONDS WHAT COMMAND...: until COMMAND succeeds; its status 2 gives up
  local seconds=$1 what=$2 rc
  shift 2
  local deadline=$((SECONDS + seconds))
  while true; do
    rc=0
    "$@" || rc=$?
    [ $rc -eq 0 ] && return 0
    [ $rc -eq 2 ] && return 1
    [ $SECONDS -lt $deadline ] || { say "timed out after ${seconds}s waiting for $what"; return 1; }
    sleep 0.2
  done
}

start_etcd() {
  [ -n "$(etcd_pid)" ] && return 0
  mkdir -p "$DIR/etcd"
  setsid etcd --name pgha --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "pgha=http://127.0.0.1:$ETCD_PEER_PORT" --enable-v2 \
    --quota-backend-bytes 268435456 </dev/null >>"$DIR/etcd.log" 2>&1 &
  echo $! >"$DIR/etcd.pid"
  wait_until 20 "etcd" curl -sf "http://127.0.0.1:$ETCD_PORT/health" -o /dev/null \
    || { tail -n 20 "$DIR/etcd.log" >&2; return 1; }
}

start_node() {  # start_node N: Patroni, which starts (or makes, or rewinds) its PostgreSQL
  local n=$1 d
  d=$(node_dir "$n")
  [ -n "$(patroni_pid "$n")" ] && return 0
  mkdir -p "$d"
  chown "$RUN_AS": "$d"
  # The postgres processes a killed Patroni left: Patroni would adopt a live postmaster,
  # but node N's death means its PostgreSQL is gone too.
  local stale
  stale=$(postgres_pids "$n")
  [ -n "$stale" ] && { kill -KILL $stale 2>/dev/null || true; }
  (cd "$d" && setsid setpriv --reuid="$RUN_AS" --regid="$RUN_AS" --init-groups \
    patroni "$d/patroni.yml" </dev/null >>"$d/patroni.out" 2>&1 &)
}

member_json() {  # the cluster's members as Patroni's REST API of any live node sees them
  local n
  for n in "${NODES[@]}"; do
    curl -sf --max-time 1 "http://127.0.0.1:$(rest_port "$n")/cluster" 2>/dev/null && return 0
  done
  return 1
}

members() {  # "name role state lag timeline" per member, from the REST API
  member_json | /usr/bin/python3 -c '
import json, sys
for m in json.load(sys.stdin)["members"]:
    print(m["name"], m["role"], m["state"], m.get("lag", "-"), m.get("timeline", "-"))'
}

cmd_leader() {
  local found
  found=$(members 2>/dev/null | awk '$2 == "leader" && $3 == "running" {print $1}')
  [ -n "$found" ] || return 1
  echo "${found#node}"
}

healthy() {  # three members, one running leader, two replicas streaming with no lag; HAProxy agrees
  local rows leader
  rows=$(members 2>/dev/null) || return 1
  [ "$(echo "$rows" | wc -l)" -eq 3 ] || return 1
  [ "$(echo "$rows" | awk '$2 == "leader" && $3 == "running"' | wc -l)" -eq 1 ] || return 1
  [ "$(echo "$rows" | awk '$2 != "leader" && $3 ~ /^(running|streaming)$/ && $4 == "0"' | wc -l)" -eq 2 ] \
    || return 1
  leader=$(echo "$rows" | awk '$2 == "leader" {print $1}')
  # Patroni 3.0 says "running" of a replica that is not streaming yet: ask the leader.
  [ "$(sql "${leader#node}" "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")" = 2 ] \
    || return 1
  [ "$(through_proxy)" = "$leader" ]
}

sql() {  # sql N STATEMENT: one value from node N
  psql -h 127.0.0.1 -p "$(pg_port "$1")" -U postgres -d postgres -XAtq -c "$2" 2>/dev/null
}

through_proxy() {  # the node a new connection through HAProxy reaches
  local port
  port=$(psql -h 127.0.0.1 -p "$PROXY_PORT" -U postgres -d postgres -XAtq -c "SELECT inet_server_port()" 2>/dev/null)
  [ -n "$port" ] && echo "node$((port - 5440))"
}

cmd_wait_healthy() {
  local seconds=${1:-60}
  wait_until "$seconds" "a healthy cluster (one leader, two streaming replicas, HAProxy on the leader)" healthy || {
    cmd_status >&2
    return 1
  }
}

start_haproxy() {
  [ -n "$(haproxy_pid)" ] && return 0
  fill "$HERE/haproxy.cfg" 0 false >"$DIR/haproxy.cfg"
  haproxy -c -q -f "$DIR/haproxy.cfg" || die "bad HAProxy configuration"
  haproxy -D -f "$DIR/haproxy.cfg" -p "$DIR/haproxy.pid"
}

create_databases() {
  local db leader
  leader=$(cmd_leader)
  for db in ${DATABASES//,/ }; do
    [ "$(sql "$leader" "SELECT 1 FROM pg_database WHERE datname = '$db'")" = 1 ] \
      || sql "$leader" "CREATE DATABASE \"$db\"" >/dev/null
  done
}

cmd_mode() {  # cmd_mode sync|async: the cluster's replication mode, changed in etcd
  local want
  case "${1:-}" in
    sync) want=true ;;
    async) want=false ;;
    *) die "which mode? sync or async, not '${1:-}'" ;;
  esac
  patronictl -c "$(node_dir 1)/patroni.yml" edit-config --force --quiet \
    -s "synchronous_mode=$want" >/dev/null
  # The leader names a synchronous standby (or none) on its next loop.
  wait_until 30 "the $1 mode to take effect" mode_is "$1"
}

mode_is() {
  local roles
  roles=$(members 2>/dev/null | awk '{print $2}')
  if [ "$1" = sync ]; then echo "$roles" | grep -qx sync_standby; else ! echo "$roles" | grep -qx sync_standby; fi
}

cmd_up() {
  local sync=${PGHA_SYNC:-0} started=$SECONDS n
  [ "${1:-}" = "--sync" ] && sync=1
  install_packages
  if [ -z "$(etcd_pid)" ] && [ -z "$(patroni_pid 1)$(patroni_pid 2)$(patroni_pid 3)" ]; then
    say "creating a cluster in $DIR"
    rm -rf "$DIR"
  fi
  mkdir -p "$DIR"
  for n in "${NODES[@]}"; do
    mkdir -p "$(node_dir "$n")"
    fill "$HERE/patroni.yml" "$n" "$([ "$sync" = 1 ] && echo true || echo false)" >"$(node_dir "$n")/patroni.yml"
  done
  chown -R "$RUN_AS": "$DIR"
  start_etcd
  start_node 1  # the first to start makes the cluster; the others copy it (pg_basebackup)
  wait_until 60 "node1 to lead" cmd_leader >/dev/null
  for n in 2 3; do start_node "$n"; done
  start_haproxy
  cmd_wait_healthy 90
  cmd_mode "$([ "$sync" = 1 ] && echo sync || echo async)"
  create_databases
  say "up in $((SECONDS - started))s ($([ "$sync" = 1 ] && echo synchronous || echo asynchronous) replication):" \
      "nodes at 127.0.0.1:5441-5443, leader node$(cmd_leader), HAProxy at 127.0.0.1:$PROXY_PORT"
}

stop_pid() {  # stop_pid PID SECONDS: SIGTERM (after SIGCONT), then SIGKILL
  local pid=$1 deadline=$((SECONDS + $2))
  kill -CONT "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  while kill -0 "$pid" 2>/dev/null; do
    if [ $SECONDS -ge $deadline ]; then
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.1
  done
}

cmd_down() {
  local pid n
  pid=$(haproxy_pid)
  [ -n "$pid" ] && stop_pid "$pid" 5
  # Killed outright: the data is thrown away next, so a clean shutdown buys nothing.
  # In a subshell: kill_node dies (exits) on a node that is not running.
  for n in "${NODES[@]}"; do (kill_node "$n") 2>/dev/null || true; done
  pid=$(etcd_pid)
  [ -n "$pid" ] && stop_pid "$pid" 5
  rm -rf "$DIR"
  say "down"
}

kill_node() {  # the whole node dies at once: Patroni (else it would restart PostgreSQL) and PostgreSQL
  local pids
  pids="$(patroni_pid "$1") $(postgres_pids "$1")"
  [ -n "${pids// /}" ] || die "node$1 is not running"
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  wait_until 10 "node$1's processes to exit" gone $pids
}

gone() {
  local pid
  for pid in "$@"; do
    kill -0 "$pid" 2>/dev/null && return 1
  done
  return 0
}

cmd_start() {
  local n=$1
  [ -n "$(etcd_pid)" ] || die "etcd is not running; use up"
  start_node "$n"
  wait_until 90 "node$n to rejoin as a streaming replica or lead" node_back "$n" || {
    tail -n 30 "$(node_dir "$n")/patroni.log" >&2 || true
    return 1
  }
}

node_back() {
  members 2>/dev/null | awk -v name="node$1" '$1 == name && ($3 == "streaming" || $3 == "running")' | grep -q .
}

signal_postgres() {  # signal_postgres N SIGNAL: node N's postmaster and its children
  local pids
  pids=$(postgres_pids "$1")
  [ -n "$pids" ] || die "node$1's PostgreSQL is not running"
  # shellcheck disable=SC2086
  kill -"$2" $pids
}

walreceiver_pid() {
  local pid
  pid=$(postmaster_pid "$1")
  [ -n "$pid" ] || die "node$1's PostgreSQL is not running"
  pgrep -P "$pid" -f 'walreceiver' || die "node$1 has no walreceiver (is it the leader?)"
}

cmd_switchover() {
  local old new
  old=$(cmd_leader) || die "no leader"
  patronictl -c "$(node_dir 1)/patroni.yml" switchover --leader "node$old" --force >/dev/null
  wait_until 60 "a new leader" new_leader "$old"
  new=$(cmd_leader)
  echo "$new"
}

new_leader() { local now; now=$(cmd_leader 2>/dev/null) && [ "$now" != "$1" ]; }

cmd_status() {
  local n pid process
  members 2>/dev/null | awk '{printf "%s  %-12s %-10s lag %s, timeline %s\n", $1, $2, $3, $4, $5}' \
    || echo "no member answers"
  for n in "${NODES[@]}"; do
    pid=$(postmaster_pid "$n")
    process="patroni ${pid:+pid $(patroni_pid "$n")}"
    [ -n "$(patroni_pid "$n")" ] || process="patroni dead"
    if [ -z "$pid" ]; then
      process+=", postgres dead"
    elif [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = "T" ]; then
      process+=", postgres pid $pid stopped (SIGSTOP)"
    else
      process+=", postgres pid $pid"
    fi
    printf 'node%s  %s\n' "$n" "$process"
  done
  pid=$(haproxy_pid)
  if [ -z "$pid" ]; then
    echo "haproxy dead"
  else
    echo "haproxy pid $pid at 127.0.0.1:$PROXY_PORT, stats http://127.0.0.1:$STATS_PORT/"
    if [ -S "$DIR/haproxy.sock" ]; then
      echo "show stat" | socat stdio "unix-connect:$DIR/haproxy.sock" 2>/dev/null \
        | awk -F, '$1 == "primary" && $2 ~ /^node/ {printf "  %s %s, %s current sessions\n", $2, $18, $5}'
    fi
  fi
}

case "${1:-}" in
  up) cmd_up "${2:-}" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  leader) cmd_leader || die "no leader" ;;
  wait-healthy) cmd_wait_healthy "${2:-60}" ;;
  kill) check_node "${2:-}"; kill_node "$2" ;;
  kill-leader) n=$(cmd_leader) || die "no leader"; kill_node "$n"; echo "$n" ;;
  start) check_node "${2:-}"; cmd_start "$2" ;;
  stop) check_node "${2:-}"; signal_postgres "$2" STOP ;;
  cont) check_node "${2:-}"; signal_postgres "$2" CONT ;;
  switchover) cmd_switchover ;;
  mode) cmd_mode "${2:-}" ;;
  pause-replication) check_node "${2:-}"; kill -STOP "$(walreceiver_pid "$2")" ;;
  resume-replication) check_node "${2:-}"; kill -CONT "$(walreceiver_pid "$2")" ;;
  walreceiver) check_node "${2:-}"; walreceiver_pid "$2" ;;
  *)
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
