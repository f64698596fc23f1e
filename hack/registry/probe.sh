# shellcheck shell=bash
# http_probe WHAT URL SECONDS [CURL_ARG...]: 0 if URL answers HTTP at all (any status, 401
# and 404 included: something is there); else 1, and why not on stdout, naming WHAT (a
# DNS failure, a refused connection, no answer within SECONDS). Sourced by pull.sh and
# download.sh, which each probe a host once per run with it.
http_probe() {
  local what="$1" url="$2" t="$3" code rc=0
  shift 3
  code="$(curl -s -o /dev/null -w '%{http_code}' --connect-timeout "$t" --max-time "$t" \
          "$@" "$url" 2>/dev/null)" || rc=$?
  if [ -n "$code" ] && [ "$code" != 000 ]; then return 0; fi
  case "$rc" in
    6) echo "cannot resolve $what" ;;
    7) echo "$what refused the connection" ;;
    28) echo "$what did not answer within ${t}s" ;;
    *) echo "$what did not answer (curl exit $rc)" ;;
  esac
  return 1
}
