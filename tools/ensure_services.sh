#!/usr/bin/env bash
# Installs the servers and tools the test suite uses (redis-server, redis-cli, tmux, prometheus) from the system's packages when they
# are missing and we may install (root with apt-get). Never fails the build: tests that need a missing
# server skip with a clear reason.
set -u
# tmux: the test of `tierkv top` drives it in a tmux pane (send-keys, capture-pane)
if ! command -v tmux >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "tierkv: installing tmux for the tierkv top test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux) \
      >/tmp/tierkv-apt-tmux.log 2>&1 || echo "tierkv: could not install tmux (see /tmp/tierkv-apt-tmux.log); the top test will skip"
  else
    echo "tierkv: tmux not found and cannot install it here; the tierkv top test will skip"
  fi
fi
# prometheus: the dashboard test evaluates every query of configs/grafana-tierkv.json in a real Prometheus
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "tierkv: installing prometheus for the dashboard test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
      >/tmp/tierkv-apt-prometheus.log 2>&1 || echo "tierkv: could not install prometheus (see /tmp/tierkv-apt-prometheus.log); the dashboard test will skip"
    # the package may start a system Prometheus; the test starts its own on a free port
    (command -v systemctl >/dev/null 2>&1 && systemctl stop prometheus) >/dev/null 2>&1 || true
    pkill -x prometheus >/dev/null 2>&1 || true
  else
    echo "tierkv: prometheus not found and cannot install it here; the dashboard test will skip"
  fi
fi
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "tierkv: installing redis-server for the remote-tier tests"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools) \
    >/tmp/tierkv-apt.log 2>&1 || echo "tierkv: could not install redis-server (see /tmp/tierkv-apt.log); redis tests will skip"
  # Debian's package starts a system redis on 6379; the tests start their own servers on free ports.
  (command -v systemctl >/dev/null 2>&1 && systemctl stop redis-server) >/dev/null 2>&1 || true
  pkill -x redis-server >/dev/null 2>&1 || true
else
  echo "tierkv: redis-server not found and cannot install it here; redis tests will skip"
fi
exit 0
