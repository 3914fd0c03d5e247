#!/bin/sh
# HAProxy's external check of a Galera node (galera/cluster.sh): healthy when the node
# answers and is Synced and ready, so that a joiner, a donor or a node cut off from the
# cluster (whose queries fail) gets no clients. HAProxy passes the server's address and
# port as the third and fourth arguments; the user needs no privilege.
out=$(mariadb --no-defaults --protocol=tcp -h "$3" -P "$4" -u haproxy_check --connect-timeout=1 -N -B -e \
  "SHOW GLOBAL STATUS WHERE Variable_name IN ('wsrep_local_state', 'wsrep_ready')" 2>/dev/null) || exit 1
case "$out" in
  *"wsrep_local_state	4"*) ;;
  *) exit 1 ;;
esac
case "$out" in
  *"wsrep_ready	ON"*) exit 0 ;;
esac
exit 1
