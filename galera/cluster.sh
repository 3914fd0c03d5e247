#!/usr/bin/env bash
# A three-node MariaDB Galera cluster on this machine, behind HAProxy, for tests/galera.
#
#   galera/cluster.sh up            install what is missing, start the cluster and HAProxy
#   galera/cluster.sh down          stop everything and remove the data
#   galera/cluster.sh status        each node's state, the cluster's size, HAProxy's view
#   galera/cluster.sh kill N        SIGKILL node N (1, 2 or 3)
#   galera/cluster.sh stop N        SIGSTOP node N (it hangs: connections stay open, no answer)
#   galera/cluster.sh cont N        SIGCONT node N
#   galera/cluster.sh start N       start a dead node again; it rejoins (IST, else SST) and syncs
#   galera/cluster.sh wait-synced   wait until all three nodes are Synced in one cluster of 3
#
# Node N answers SQL on 127.0.0.1:331N, talks to its peers on 457N (gcomm), receives
# incremental state transfers on 458N and full ones (rsync) on 459N. HAProxy listens on
# 127.0.0.1:3310 as a single writer: node1 active, nodes 2 and 3 backups, each checked
# every half second for being Synced (galera/check.sh), so that a dead or hung node is out
# within about two seconds and its client sessions are cut (they reconnect to the next).
# HAProxy's statistics: http://127.0.0.1:3319/. Everything lives in $GALERA_DIR
# (default /tmp/leases-galera): data, configuration, logs and pid files.
# Small buffers and no fsync: this is a test rig, not a production layout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${GALERA_DIR:-/tmp/leases-galera}
PROVIDER=${GALERA_PROVIDER:-/usr/lib/galera/libgalera_smm.so}
DATABASES=${GALERA_DATABASES:-leases_galera}
# The servers run as mysql, as packaged ones do: run by root, the rsync daemon of a state
# transfer (full or incremental) would write as "nobody" into a data directory of root's.
RUN_AS=${GALERA_USER:-mysql}
PROXY_PORT=3310
STATS_PORT=3319
CHECK_USER=haproxy_check
NODES=(1 2 3)
CLUSTER_ADDRESS="gcomm://127.0.0.1:4571,127.0.0.1:4572,127.0.0.1:4573"
# Failure detection in a second or two instead of the default five to fifteen seconds:
# the peers of a dead or hung node stall their commits until they drop it from the view.
EVS="evs.keepalive_period=PT0.3S;evs.inactive_check_period=PT0.5S;evs.suspect_timeout=PT1.5S"
EVS+=";evs.inactive_timeout=PT3S;evs.install_timeout=PT3S"
EVS+=";gmcast.peer_timeout=PT2S"
OPTIONS="gcache.size=64M;$EVS"

say() { printf 'galera: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

sql_port() { echo $((3310 + $1)); }
node_dir() { echo "$DIR/node$1"; }

check_node() {
  case "${1:-}" in
    1|2|3) ;;
    *) die "which node? 1, 2 or 3, not '${1:-}'" ;;
  esac
}

install_packages() {
  local missing=()
  [ -x /usr/sbin/mariadbd ] && command -v mariadb-install-db >/dev/null || missing+=(mariadb-server)
  [ -e "$PROVIDER" ] || missing+=(galera-4)
  command -v haproxy >/dev/null || missing+=(haproxy)
  command -v rsync >/dev/null || missing+=(rsync)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  [ -e "$PROVIDER" ] || die "no Galera provider at $PROVIDER (set GALERA_PROVIDER)"
  id "$RUN_AS" >/dev/null 2>&1 || die "no user $RUN_AS to run the servers as (set GALERA_USER)"
}

write_config() {
  local n=$1 d
  d=$(node_dir "$n")
  cat >"$d/my.cnf" <<EOF
[mysqld]
user = $RUN_AS
datadir = $d/data
socket = $d/mysqld.sock
pid-file = $d/mariadbd.pid
log-error = $d/error.log
bind-address = 127.0.0.1
port = $(sql_port "$n")
skip-name-resolve
character-set-server = utf8mb4
collation-server = utf8mb4_general_ci
performance_schema = OFF
max_connections = 300
innodb_buffer_pool_size = 48M
innodb_log_file_size = 16M
innodb_flush_log_at_trx_commit = 0
innodb_doublewrite = 0
binlog_format = ROW
default_storage_engine = InnoDB
innodb_autoinc_lock_mode = 2

wsrep_on = ON
wsrep_provider = $PROVIDER
wsrep_cluster_name = leases-galera
wsrep_cluster_address = $CLUSTER_ADDRESS
wsrep_node_name = node$n
wsrep_node_address = 127.0.0.1:457$n
wsrep_node_incoming_address = 127.0.0.1:$(sql_port "$n")
wsrep_provider_options = "gmcast.listen_addr=tcp://127.0.0.1:457$n;ist.recv_addr=127.0.0.1:458$n;$OPTIONS"
wsrep_sst_method = rsync
wsrep_sst_receive_address = 127.0.0.1:459$n
wsrep_slave_threads = 2
EOF
}

client() {  # client N [mariadb options...]
  local n=$1
  shift
  mariadb --no-defaults --protocol=tcp -h127.0.0.1 -P"$(sql_port "$n")" -uroot --connect-timeout=2 -N -B "$@"
}

# The pid of node N's server if it is alive (stopped counts as alive), else nothing.
node_pid() {
  local pidfile pid
  pidfile="$(node_dir "$1")/mariadbd.pid"
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "node$1/my.cnf"; then
    echo "$pid"
  fi
}

# wsrep_local_state_comment and wsrep_cluster_size of node N, or nothing if it does not answer.
node_state() {
  client "$1" --connect-timeout=1 -e \
    "SELECT MAX(IF(VARIABLE_NAME = 'WSREP_LOCAL_STATE_COMMENT', VARIABLE_VALUE, NULL)),
            MAX(IF(VARIABLE_NAME = 'WSREP_CLUSTER_SIZE', VARIABLE_VALUE, NULL)),
            MAX(IF(VARIABLE_NAME = 'WSREP_READY', VARIABLE_VALUE, NULL))
     FROM information_schema.GLOBAL_STATUS" 2>/dev/null || true
}

synced() {  # node N is Synced, ready, in a cluster of `size` nodes
  local state
  state=$(node_state "$1")
  [ "$state" = "$(printf 'Synced\t%s\tON' "${2:-3}")" ]
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

# Where node N's data stopped, for an incremental transfer when it starts again: the
# server finds it with --wsrep-recover (what galera_recovery does under systemd).
recovered_position() {
  local n=$1 d log
  d=$(node_dir "$n")
  log="$d/recover.log"
  /usr/sbin/mariadbd --defaults-file="$d/my.cnf" --wsrep-recover --log-error="$log" >/dev/null 2>&1 || true
  sed -n 's/.*WSREP: Recovered position: *\([0-9a-f-]*:-\?[0-9]*\).*/\1/p' "$log" | tail -n 1
  rm -f "$log"
}

started() {  # started PID PIDFILE: the server wrote its pid file; fails at once if it exited
  kill -0 "$1" 2>/dev/null || { say "the server exited"; return 2; }
  test -s "$2"
}

start_node() {  # start_node N [extra mariadbd options]
  local n=$1 d position
  shift
  d=$(node_dir "$n")
  [ -n "$(node_pid "$n")" ] && { say "node$n is already running"; return 0; }
  rm -f "$d/mariadbd.pid"
  local extra=("$@")
  if [ -f "$d/data/grastate.dat" ] && grep -q '^seqno: *-1' "$d/data/grastate.dat"; then
    position=$(recovered_position "$n")
    [ -n "$position" ] && extra+=("--wsrep-start-position=$position")
  fi
  setsid /usr/sbin/mariadbd --defaults-file="$d/my.cnf" "${extra[@]}" </dev/null >>"$d/error.log" 2>&1 &
  local pid=$!
  wait_until 30 "node$n to write its pid file" started "$pid" "$d/mariadbd.pid" || {
    tail -n 30 "$d/error.log" >&2
    return 1
  }
}

wait_node_synced() {  # wait_node_synced N SIZE SECONDS
  wait_until "$3" "node$1 to be Synced in a cluster of $2" synced "$1" "$2" || {
    tail -n 30 "$(node_dir "$1")/error.log" >&2
    return 1
  }
}

init_data() {
  rm -rf "$DIR"
  mkdir -p "$DIR"
  local n
  for n in "${NODES[@]}"; do
    mkdir -p "$(node_dir "$n")"
    write_config "$n"
  done
  mariadb-install-db --no-defaults --datadir="$(node_dir 1)/data" --user="$RUN_AS" \
    --auth-root-authentication-method=normal --skip-test-db >"$DIR/install.log" 2>&1 \
    || { cat "$DIR/install.log" >&2; die "mariadb-install-db failed"; }
  mkdir -p "$(node_dir 2)/data" "$(node_dir 3)/data"  # filled by a full state transfer
  chown -R "$RUN_AS": "$DIR"
}

create_databases() {
  local db statements="CREATE USER IF NOT EXISTS '$CHECK_USER'@'%';"
  for db in ${DATABASES//,/ }; do
    statements+="CREATE DATABASE IF NOT EXISTS \`$db\` CHARACTER SET utf8mb4;"
  done
  client 1 -e "$statements"
}

haproxy_pid() {
  local pid
  [ -s "$DIR/haproxy.pid" ] || return 0
  pid=$(head -n 1 "$DIR/haproxy.pid")
  if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$DIR/haproxy.cfg"; then
    echo "$pid"
  fi
}

start_haproxy() {
  [ -n "$(haproxy_pid)" ] && return 0
  cat >"$DIR/haproxy.cfg" <<EOF
global
    maxconn 2000
    external-check
    insecure-fork-wanted
    stats socket $DIR/haproxy.sock mode 600 level admin

defaults
    mode tcp
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    timeout check 1s
    retries 2
    option redispatch

# One writer: node1, then the first healthy backup. A node counts as up when it answers
# and is Synced; it is out after two failed checks (about a second), and its client
# sessions are cut then, so that clients reconnect through the next node. It is back
# after three good checks: a node resumed after a SIGSTOP says Synced for a moment before
# it notices that the others dropped it, and must not get clients in that moment.
listen galera
    bind 127.0.0.1:$PROXY_PORT
    option external-check
    external-check path "/usr/bin:/bin"
    external-check command $HERE/check.sh
    default-server inter 500ms fall 2 rise 3 on-marked-down shutdown-sessions
    server node1 127.0.0.1:3311 check
    server node2 127.0.0.1:3312 check backup
    server node3 127.0.0.1:3313 check backup

listen stats
    mode http
    bind 127.0.0.1:$STATS_PORT
    stats enable
    stats uri /
    stats refresh 2s
EOF
  haproxy -c -q -f "$DIR/haproxy.cfg" || die "bad HAProxy configuration"
  haproxy -D -f "$DIR/haproxy.cfg" -p "$DIR/haproxy.pid"
  wait_until 10 "HAProxy to route to a node" \
    mariadb --no-defaults --protocol=tcp -h127.0.0.1 -P"$PROXY_PORT" -u"$CHECK_USER" --connect-timeout=1 \
    -N -B -e "SELECT 1" >/dev/null 2>&1
}

running_nodes() {
  local n
  for n in "${NODES[@]}"; do
    [ -n "$(node_pid "$n")" ] && echo "$n"
  done
  return 0
}

cmd_up() {
  install_packages
  local started=$SECONDS alive n
  alive=$(running_nodes)
  if [ -z "$alive" ]; then
    say "creating a cluster in $DIR"
    init_data
    start_node 1 --wsrep-new-cluster
    wait_node_synced 1 1 30
    for n in 2 3; do  # one joiner at a time: node1 donates to each in turn
      start_node "$n"
      wait_node_synced "$n" "$n" 60
    done
  else
    for n in "${NODES[@]}"; do
      if [ -z "$(node_pid "$n")" ]; then
        say "node$n is not running; starting it"
        start_node "$n"
      fi
    done
  fi
  cmd_wait_synced 60
  create_databases
  start_haproxy
  say "up in $((SECONDS - started))s: nodes at 127.0.0.1:3311-3313, HAProxy at 127.0.0.1:$PROXY_PORT"
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
  for n in "${NODES[@]}"; do
    pid=$(node_pid "$n")
    # Killed outright: the data is thrown away next, so a clean shutdown buys nothing.
    [ -n "$pid" ] && { kill -KILL "$pid" 2>/dev/null || true; }
  done
  for n in "${NODES[@]}"; do
    wait_until 10 "node$n to exit" test -z "$(node_pid "$n")" || true
  done
  rm -rf "$DIR"
  say "down"
}

cmd_status() {
  local n pid state process
  for n in "${NODES[@]}"; do
    pid=$(node_pid "$n")
    if [ -z "$pid" ]; then
      process="dead"
    elif [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = "T" ]; then
      process="stopped (SIGSTOP)"
    else
      process="running"
    fi
    state=""
    [ "$process" = "running" ] && state=$(node_state "$n")
    if [ -n "$state" ]; then
      # shellcheck disable=SC2086
      set -- $state
      printf 'node%s  pid %-8s %-8s %s, cluster size %s, ready %s\n' "$n" "$pid" "$process" "$1" "$2" "$3"
    else
      printf 'node%s  pid %-8s %s\n' "$n" "${pid:--}" "$process"
    fi
  done
  pid=$(haproxy_pid)
  if [ -z "$pid" ]; then
    echo "haproxy dead"
  else
    echo "haproxy pid $pid at 127.0.0.1:$PROXY_PORT, stats http://127.0.0.1:$STATS_PORT/"
    if command -v socat >/dev/null && [ -S "$DIR/haproxy.sock" ]; then
      echo "show stat" | socat stdio "unix-connect:$DIR/haproxy.sock" 2>/dev/null \
        | awk -F, '$1 == "galera" && $2 ~ /^node/ {printf "  %s %s, %s current sessions\n", $2, $18, $5}'
    fi
  fi
}

cmd_wait_synced() {
  local seconds=${1:-60} n
  for n in "${NODES[@]}"; do
    wait_node_synced "$n" 3 "$seconds"
  done
}

cmd_start() {
  local n=$1 others=0 m
  for m in "${NODES[@]}"; do
    [ "$m" != "$n" ] && [ -n "$(node_pid "$m")" ] && others=$((others + 1))
  done
  [ $others -gt 0 ] || die "no other node is running to rejoin; use down and up"
  if ! { start_node "$n" && wait_node_synced "$n" $((others + 1)) 60; }; then
    # What it holds cannot be brought up to date (or the transfer failed): start over
    # from an empty data directory, filled by a full state transfer.
    say "node$n could not rejoin as it was; starting it again with a full state transfer"
    kill -KILL "$(node_pid "$n")" 2>/dev/null || true
    rm -rf "$(node_dir "$n")/data"
    mkdir -p "$(node_dir "$n")/data"
    chown "$RUN_AS": "$(node_dir "$n")/data"
    start_node "$n"
    wait_node_synced "$n" $((others + 1)) 60
  fi
}

signal_node() {  # signal_node N SIGNAL
  local pid
  pid=$(node_pid "$1")
  [ -n "$pid" ] || die "node$1 is not running"
  kill -"$2" "$pid"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  wait-synced) cmd_wait_synced "${2:-60}" ;;
  kill) check_node "${2:-}"; signal_node "$2" KILL ;;
  stop) check_node "${2:-}"; signal_node "$2" STOP ;;
  cont) check_node "${2:-}"; signal_node "$2" CONT ;;
  start) check_node "${2:-}"; cmd_start "$2" ;;
  *)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
