#!/usr/bin/env bash
# Builds (or finds in its cache) the two binaries of a real Kubernetes API server for custom resources:
# apiextensions-apiserver (built from Debian sid's packaged Go sources) and etcd (Debian's etcd-server).
#
# Nothing is installed system-wide: apt runs with a private source list, lists, cache and an empty dpkg
# status under the work folder, packages are `apt-get download`ed and `dpkg -x`ed there, and Go builds
# with GO111MODULE=off GOPATH=<root>/usr/share/gocode GOPROXY=off (no module download).
#
# The result lies in $KVSERVE_K8S_CACHE/<key>/bin (default ~/.cache/kvserve-k8s), <key> a hash of the
# package names and versions the build used, so a changed package builds anew and an unchanged one is
# reused. `latest` links the newest complete build; tests/operator/apiserver.py finds it there.
#
# Usage: tools/k8s_apiserver/build.sh        prints progress on stderr and the bin folder on stdout.
# Env:   KVSERVE_K8S_CACHE  cache root;  KVSERVE_K8S_SUITE  Debian suite of the Go sources (default sid).
set -euo pipefail

CACHE="${KVSERVE_K8S_CACHE:-$HOME/.cache/kvserve-k8s}"
SUITE="${KVSERVE_K8S_SUITE:-sid}"
WORK="$CACHE/work-$SUITE"
say() { printf '[k8s-apiserver %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The Debian mirror this machine already uses (first URI of a Debian main archive in its apt sources).
mirror() {
  local m
  m=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
      | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//; s/[[:space:]].*$//' \
      | grep -E '/debian/?$' | head -n1)
  [ -n "$m" ] || { say "no Debian mirror found in /etc/apt/sources.list*"; exit 1; }
  echo "${m%/}"
}

mkdir -p "$WORK"/{lists/partial,cache/archives/partial,debs,etc/preferences.d,etc/sources.list.d}
# One build at a time per cache (parallel test workers, two checkouts): the second waits, then finds it cached.
exec 9>"$CACHE/.lock"
flock 9
: > "$WORK/status"
echo "deb $(mirror) $SUITE main" > "$WORK/etc/sources.list"
APT_OPTS=(
  -o "Dir::Etc::sourcelist=$WORK/etc/sources.list"
  -o "Dir::Etc::sourceparts=$WORK/etc/sources.list.d"
  -o "Dir::Etc::preferences=$WORK/etc/preferences"
  -o "Dir::Etc::preferencesparts=$WORK/etc/preferences.d"
  -o "Dir::State::Lists=$WORK/lists"
  -o "Dir::State::status=$WORK/status"
  -o "Dir::Cache=$WORK/cache"
  -o "APT::Architecture=amd64"
  -o "Debug::NoLocking=1"
  -o "APT::Sandbox::User=root"
)

say "apt-get update ($SUITE, private lists under $WORK)"
if ! apt-get "${APT_OPTS[@]}" update -qq >&2; then
  # Offline (or the mirror failed): a complete earlier build still serves.
  if [ -x "$CACHE/latest/bin/apiextensions-apiserver" ] && [ -x "$CACHE/latest/bin/etcd" ]; then
    say "apt-get update failed: using the cached build $(readlink -f "$CACHE/latest")"
    echo "$CACHE/latest/bin"
    exit 0
  fi
  say "apt-get update failed and nothing is cached"; exit 1
fi

# The dependency closure, resolved by apt: every golang-* package that the API server's sources and the Go
# toolchain need (the toolchain is static; libc and friends are not needed to build with CGO_ENABLED=0).
ROOTS=(golang-k8s-apiextensions-apiserver-dev golang-go)
say "resolving the dependency closure of ${ROOTS[*]}"
mapfile -t PKGS < <(apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
    --no-breaks --no-replaces --no-enhances "${ROOTS[@]}" \
  | grep -E '^golang-' | sort -u)
# A virtual name (one that no package carries) has no candidate: keep only real packages.
VERSIONS=$(apt-cache "${APT_OPTS[@]}" policy "${PKGS[@]}" \
  | awk '/^[^ ]/{p=$1; sub(":$","",p)} /Candidate:/{ if ($2 != "(none)") print p"="$2 }' | sort -u)
ETCD_VERSION=$(apt-cache "${APT_OPTS[@]}" policy etcd-server | awk '/Candidate:/{print $2}')
[ -n "$ETCD_VERSION" ] && [ "$ETCD_VERSION" != "(none)" ] || { say "etcd-server not in $SUITE"; exit 1; }
N=$(wc -l <<<"$VERSIONS")
KEY=$(printf '%s\netcd-server=%s\n' "$VERSIONS" "$ETCD_VERSION" | sha256sum | cut -c1-16)
OUT="$CACHE/$KEY"
say "$N golang packages + etcd-server=$ETCD_VERSION; cache key $KEY"

if [ -x "$OUT/bin/apiextensions-apiserver" ] && [ -x "$OUT/bin/etcd" ]; then
  say "cached: $OUT/bin"
  ln -sfn "$KEY" "$CACHE/latest"
  echo "$OUT/bin"
  exit 0
fi

say "downloading $N packages + etcd-server into $WORK/debs"
cd "$WORK/debs"  # apt-get download writes into the current folder
# Fetch only the files not downloaded before (a rerun after a failure, or a few changed versions).
MISSING=()
while IFS= read -r pv; do
  p=${pv%%=*}; v=${pv#*=}; vf=${v//:/%3a}
  compgen -G "${p}_${vf}_*.deb" >/dev/null || MISSING+=("$pv")
done <<<"$VERSIONS"$'\n'"etcd-server=$ETCD_VERSION"
if [ "${#MISSING[@]}" -gt 0 ]; then
  apt-get "${APT_OPTS[@]}" download -q "${MISSING[@]}" >&2
fi

ROOT="$OUT/root"
mkdir -p "$OUT/bin"
unpack() {  # unpack PKG=VERSION...: dpkg -x each downloaded package into $ROOT
  local pv p v vf
  for pv in "$@"; do
    p=${pv%%=*}; v=${pv#*=}; vf=${v//:/%3a}
    dpkg -x "$(compgen -G "$WORK/debs/${p}_${vf}_*.deb" | head -n1)" "$ROOT"
  done
}
if [ ! -x "$OUT/bin/apiextensions-apiserver" ]; then
  rm -rf "$ROOT" && mkdir -p "$ROOT"
  say "unpacking $N packages into $ROOT"
  mapfile -t GOPKGS <<<"$VERSIONS"
  unpack "${GOPKGS[@]}"
  GO=$(compgen -G "$ROOT/usr/lib/go-*/bin/go" | head -n1)
  [ -x "$GO" ] || { say "no go binary in the unpacked golang-go"; exit 1; }
  say "building k8s.io/apiextensions-apiserver with $("$GO" version) (several minutes)"
  T0=$(date +%s)
  (
    cd "$ROOT/usr/share/gocode/src/k8s.io/apiextensions-apiserver"
    env GOROOT="$(dirname "$(dirname "$GO")")" GO111MODULE=off GOPATH="$ROOT/usr/share/gocode" GOPROXY=off \
        CGO_ENABLED=0 GOCACHE="$WORK/gocache" GOTOOLCHAIN=local GOFLAGS= \
        "$GO" build -o "$OUT/bin/apiextensions-apiserver.tmp" .
  )
  mv "$OUT/bin/apiextensions-apiserver.tmp" "$OUT/bin/apiextensions-apiserver"
  say "built in $(( $(date +%s) - T0 )) s"
fi
# etcd: Debian's binary as packaged (it links only libc).
rm -rf "$ROOT" && mkdir -p "$ROOT"
unpack "etcd-server=$ETCD_VERSION"
[ -x "$ROOT/usr/bin/etcd" ] || { say "no usr/bin/etcd in etcd-server"; exit 1; }
cp "$ROOT/usr/bin/etcd" "$OUT/bin/etcd"
"$OUT/bin/etcd" --version >&2
printf '%s\netcd-server=%s\n' "$VERSIONS" "$ETCD_VERSION" > "$OUT/packages.txt"
# The sources are not needed once built (about 1 GB unpacked).
rm -rf "$ROOT"
ln -sfn "$KEY" "$CACHE/latest"
say "done: $OUT/bin"
echo "$OUT/bin"
