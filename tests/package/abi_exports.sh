#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# What the shared library exports (the public headers' visibility, src/rdmakit.map over it): every
# dynamic symbol it defines begins with rdmakit (a function of rdmakit, rdmakit::doctor or
# rdmakit::wire, their classes' typeinfo and vtables), none is of rdmakit::detail, of a public
# class's private Impl or of the libraries it links, each carries the version node, and the API a
# consumer calls is there.
# Usage: abi_exports.sh SHARED_OBJECT
set -eu
so=$1
command -v nm > /dev/null || { echo "FAIL: nm (binutils) is needed"; exit 1; }
syms=$(nm -DC --defined-only "$so" | awk '$2 != "A"' | sed 's/^[0-9a-f]* [A-Za-z] //')
count=$(printf '%s\n' "$syms" | grep -c .)
fail() { echo "FAIL: $*"; exit 1; }
[ "$count" -ge 100 ] || fail "only $count symbols exported"
kind='^(typeinfo (name )?for |vtable for )?'
other=$(printf '%s\n' "$syms" | grep -vE "${kind}rdmakit::" || true)
[ -z "$other" ] && echo "no symbol outside rdmakit" || fail "exports outside rdmakit:
$(printf '%s\n' "$other" | head -20)"
internal=$(printf '%s\n' "$syms" | grep -E "${kind}rdmakit::detail::" || true)
[ -z "$internal" ] && echo "no rdmakit::detail symbol" || fail "exports internals:
$(printf '%s\n' "$internal" | head -20)"
# Nor a function that takes or names one (the public classes' private constructors from their
# state are hidden too).
impl=$(printf '%s\n' "$syms" | grep -E '::Impl\b|rdmakit::detail::' || true)
[ -z "$impl" ] && echo "no symbol of or naming a private Impl or rdmakit::detail" || fail "exports private Impl or detail names:
$(printf '%s\n' "$impl" | head -20)"
for want in 'rdmakit::version()' 'rdmakit::Engine::Engine(rdmakit::EngineConfig)' 'typeinfo for rdmakit::Error' \
    'rdmakit::Connection::~Connection()' 'rdmakit::doctor::check_local(' 'rdmakit::wire::try_decode_header(' 'rdmakit::Listener::accept('; do
  printf '%s\n' "$syms" | grep -qF "$want" || fail "the public $want is not exported"
done
unversioned=$(printf '%s\n' "$syms" | grep -v '@@RDMAKIT_0\.1$' || true)
[ -z "$unversioned" ] || fail "symbols without the version node RDMAKIT_0.1:
$(printf '%s\n' "$unversioned" | head -20)"
echo "abi exports: ok ($count symbols, each versioned RDMAKIT_0.1)"
