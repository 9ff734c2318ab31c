#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The shared library's ABI is exactly what the public headers declare: every function declared in
# include/kvbridge/*.h is marked KVB_API, libkvbridge.so exports exactly those (no internal symbol
# leaks), and abi_check's list (the functions it calls) names each of them.
#
# usage: check_symbols.sh LIBKVBRIDGE_SO INCLUDE_DIR ABI_CHECK_BINARY
set -eu

lib=$1
incdir=$2
abi_check=$3
NM=${NM:-nm}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvb-abi.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' HUP INT TERM

# Function declarations in the headers, one "api NAME" or "plain NAME" per line. Comments,
# preprocessor lines (macros such as kvb_config_init() are not symbols) and typedefs are dropped;
# what is left is split into statements, and a statement naming kvb_...( declares that function.
perl -e '
    local $/;
    my $src = join "", map { open my $f, "<", $_ or die "$_: $!"; <$f> } @ARGV;
    $src =~ s{/\*.*?\*/}{ }gs;
    $src =~ s{//[^\n]*}{}g;
    $src =~ s{\\\n}{ }g;
    $src =~ s{^[ \t]*#[^\n]*}{}mg;
    for my $st (split /[;{}]/, $src) {
        next if $st =~ /\btypedef\b/;
        my ($name) = $st =~ /\b(kvb_\w+)\s*\(/ or next;
        print(($st =~ /\bKVB_API\b/ ? "api" : "plain"), " $name\n");
    }' "$incdir"/*.h >"$tmp/decls"
[ -s "$tmp/decls" ] || { echo "no function declarations found in $incdir/*.h" >&2; exit 1; }

awk '$1 == "api" { print $2 }' "$tmp/decls" | sort -u >"$tmp/headers"
$NM -D --defined-only "$lib" | awk 'NF >= 3 { sub(/@.*/, "", $3); print $3 }' | sort -u >"$tmp/all"
grep '^kvb_' "$tmp/all" >"$tmp/exports" || true
"$abi_check" --list | sort -u >"$tmp/called"

fail=0
report() { # report FILE MESSAGE: print the names in FILE under MESSAGE, if any
    if [ -s "$1" ]; then
        echo "$2:" >&2
        sed 's/^/    /' "$1" >&2
        fail=1
    fi
}

awk '$1 == "plain" { print $2 }' "$tmp/decls" | sort -u >"$tmp/x"
report "$tmp/x" "declared in $incdir without KVB_API (hidden in the shared library)"
comm -23 "$tmp/headers" "$tmp/exports" >"$tmp/x"
report "$tmp/x" "declared with KVB_API but not exported by $lib"
comm -13 "$tmp/headers" "$tmp/exports" >"$tmp/x"
report "$tmp/x" \
    "exported by $lib but declared with KVB_API in no public header (internal symbol leaked?)"
# Anything else the library exports, but for the symbols the linker itself defines.
grep -v -e '^kvb_' -e '^_init$' -e '^_fini$' -e '^_edata$' -e '^_end$' -e '^__bss_start$' \
    "$tmp/all" >"$tmp/x" || true
report "$tmp/x" "exported by $lib without the kvb_ prefix"
comm -23 "$tmp/headers" "$tmp/called" >"$tmp/x"
report "$tmp/x" \
    "public but missing from KVB_ABI_FUNCTIONS in tests/abi/abi_check.c (add a line and a call)"
comm -13 "$tmp/headers" "$tmp/called" >"$tmp/x"
report "$tmp/x" "in KVB_ABI_FUNCTIONS in tests/abi/abi_check.c but not a public function"

if [ "$fail" = 0 ]; then
    echo "ABI OK: $(wc -l <"$tmp/headers") public functions declared with KVB_API, exported, listed"
fi
exit "$fail"
