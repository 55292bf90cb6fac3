#!/usr/bin/env bash
# The services and binaries the test suite needs beyond .venv, on a fresh machine: `make test` and
# .ci/run both call this. As root with apt-get it installs what is missing (Debian packages); elsewhere
# it says what is missing, what that skips or fails, and how to get it, and carries on.
set -uo pipefail

# KVGATE_TEST_DEPS_INSTALL=0: report only, install nothing (a root machine whose packages are not ours).
can_apt() {
  [ "${KVGATE_TEST_DEPS_INSTALL:-1}" != 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]
}
updated=0
apt_install() {
  if [ "$updated" = 0 ]; then apt-get update -qq >/dev/null && updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
say() { echo "test-deps: $*" >&2; }

# Redis at 127.0.0.1:6379: the Redis session store, fleet, admission and LMCache L2 tests.
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  if ! command -v redis-server >/dev/null 2>&1 && can_apt; then apt_install redis-server || true; fi
  if command -v redis-server >/dev/null 2>&1; then
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /tmp --logfile /tmp/kvgate-test-redis.log
    for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
  else
    say "no Redis at 127.0.0.1:6379 and none to start (apt-get install redis-server): the Redis tests will fail"
  fi
fi

# Prometheus and promtool: tests/test_prometheus.py and the compose topology test run them against
# deploy/observability/ (Debian's prometheus package brings both).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if can_apt; then apt_install prometheus || say "apt-get install prometheus failed"; fi
  if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    say "prometheus/promtool not installed (not root with apt-get here): tests/test_prometheus.py fails and the"
    say "  compose topology test skips; install Debian's prometheus package, or KVGATE_PROMETHEUS_TESTS=0 make test"
  fi
fi

# dnsmasq: the DNS discovery tests run a real DNS server on loopback (the binary only).
if ! command -v dnsmasq >/dev/null 2>&1 && [ ! -x /usr/sbin/dnsmasq ]; then
  if can_apt; then apt_install dnsmasq-base || say "apt-get install dnsmasq-base failed"; fi
  if ! command -v dnsmasq >/dev/null 2>&1 && [ ! -x /usr/sbin/dnsmasq ]; then
    say "dnsmasq not installed (not root with apt-get here): the DNS discovery tests skip (apt-get install dnsmasq-base)"
  fi
fi
exit 0
