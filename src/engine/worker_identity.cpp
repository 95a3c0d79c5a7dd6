// SPDX-License-Identifier: Apache-2.0
// Who is at the other end of a link: the IDENT a worker sends (signed with the engine's identity)
// and the checks of the one it receives, against the peer that was meant (docs/security.md,
// "Engine identities"). Runs on the worker's thread.
#include <fmt/format.h>

#include "bootstrap/identity.hpp"
#include "engine/admission.hpp"
#include "engine/impl.hpp"
#include "engine/protocol.hpp"

namespace rdmakit::detail {

namespace ew = engine_wire;

namespace {

std::string key_text(const std::vector<std::uint8_t>& key) {
  return key.size() == kPublicKeySize ? encode_public_key(std::span<const std::uint8_t, kPublicKeySize>(key.data(), kPublicKeySize))
                                      : std::string("no key");
}

std::string source_text(const std::string& source) {
  if (source == "given") return "given to add_peer";
  if (source == "store") return "published in the store";
  if (source == "info") return "named in the info given to add_peer";
  return "pinned when its first link proved it";
}

}  // namespace

ew::Message Worker::my_ident(const Link& l) const {
  ew::Message m = ew::ident(e_.name, e_.epoch);
  // Engine::Impl requires a key with an identity, so every link then has a session to sign.
  if (e_.cfg.identity.empty() || !l.impl.session) return m;
  const auto key = decode_public_key(e_.cfg.identity.public_key());
  m.public_key.assign(key->begin(), key->end());
  m.signature = e_.cfg.identity.sign(
      ew::ident_transcript(l.impl.session->binding(), l.initiated, e_.name, e_.epoch, m.public_key));
  return m;
}

bool Worker::check_identity(Link& l, const ew::Message& m) {
  const std::string proved = key_text(m.public_key);
  const bool first = l.initiated && l.rail == l.peer->rails[0].get();
  // On a link this engine opened, a failure ends what waits for the peer (and a further rail is
  // not probed again); on one a peer opened, the peer is told why.
  const auto reject = [&](const std::string& why) {
    if (l.initiated) {
      wrong_engine(l, why);
    } else {
      e_.refused_identity.fetch_add(1, std::memory_order_relaxed);  // a link a peer opened (metrics)
      refuse(l, why);
    }
    return false;
  };
  l.peer_name = m.name;  // what the refusals and the logs call it
  if (!m.public_key.empty()) {
    // The signature must be of this very session (its binding), made by the other side (whose
    // role is the opposite of this one's).
    if (!l.impl.session) {
      return reject(fmt::format("'{}' sent a signed IDENT on a link without a key (no session to bind it to)", m.name));
    }
    const auto key = std::span<const std::uint8_t, kPublicKeySize>(m.public_key.data(), kPublicKeySize);
    if (!verify_signature(key, ew::ident_transcript(l.impl.session->binding(), !l.initiated, m.name, m.epoch, m.public_key),
                          m.signature)) {
      return reject(fmt::format(
          "'{}' at {} sent an IDENT whose signature does not verify with the key it names ({}): it does not hold "
          "that key's secret, or its signature is of another session (replayed or relayed)",
          m.name, l.impl.info.peer_address, proved));
    }
  }
  if (l.initiated) {
    Peer& p = *l.peer;
    if (m.name != p.name) {
      return reject(fmt::format(
          "engine '{}' answered at {} where peer '{}' was expected{}", m.name, l.impl.info.peer_address, p.name,
          p.from_store ? " (the store's entry for it is out of date: another engine took its address)"
                       : " (the address now belongs to another engine, or add_peer was given another engine's "
                         "name: the name must be the one that engine runs under)"));
    }
    std::string expected;
    std::string source;
    {
      std::lock_guard lock(e_.mu);
      // Pinned only by the peer's first link (a further rail answers with the first link's
      // identity, whatever it is: none included).
      if (first && p.public_key.empty() && !m.public_key.empty()) {
        p.public_key = proved;
        p.key_source = "pinned";
        return true;
      }
      expected = p.public_key;
      source = p.key_source;
    }
    if (expected == (m.public_key.empty() ? std::string{} : proved)) return true;
    const std::string answered = m.public_key.empty() ? std::string("proving no identity") : "with key " + proved;
    if (expected.empty()) {
      return reject(fmt::format("'{}' answered a further rail at {} {}, where its first link proved none",
                                m.name, l.impl.info.peer_address, answered));
    }
    return reject(fmt::format("'{}' answered at {} {} where its key {} ({}) was expected: {}", m.name,
                              l.impl.info.peer_address, answered, expected, source_text(source),
                              source == "store" ? "another engine took the name and the address, or the store's "
                                                  "record is not the engine's (whoever writes the store decides)"
                                                : "another engine took the name and the address, or the peer was "
                                                  "given a new key (remove_peer and add_peer it again to accept that)"));
  }
  // A link a peer opened: it must not be revoked, must be allowed, and must prove the key its
  // name is bound to here: one an allowed_peers NAME=KEY entry or add_peer gave it, or else the
  // first that linked under it (pinned).
  l.peer_key = m.public_key.empty() ? std::string{} : proved;
  std::string why, note;
  {
    std::lock_guard lock(e_.mu);
    why = admit(m.name, l.peer_key, l.impl.info.peer_address, note);
  }
  if (!note.empty()) log(note);
  if (!why.empty()) return reject(why);
  return true;
}

std::string Worker::admit(const std::string& name, const std::string& key, const std::string& from, std::string& note) {
  const std::string who = fmt::format("'{}'{}", name, key.empty() ? std::string(" (proving no identity)") : " (key " + key + ")");
  for (const std::string& r : e_.revoked) {
    if (matches(r, name, key)) {
      return fmt::format("{} is revoked by engine '{}' (Engine::revoke(\"{}\")): it is not served until allow(\"{}\")",
                         who, e_.name, r, r);
    }
  }
  if (!e_.allowed.empty() && !any_matches(e_.allowed, name, key)) {
    return fmt::format("{} is not among the peers engine '{}' allows (EngineConfig::allowed_peers, serve --allow)", who,
                       e_.name);
  }
  // The keys the operator bound the name to.
  std::vector<std::string> bound;
  for (const std::string& a : e_.allowed) {
    auto [an, ak] = split_entry(a);
    if (!ak.empty() && an == name) bound.push_back(std::move(ak));
  }
  if (const auto it = e_.peer_ids.find(name); it != e_.peer_ids.end() && e_.peers[it->second - 1]->key_source != "pinned" &&
                                              !e_.peers[it->second - 1]->public_key.empty()) {
    bound.push_back(e_.peers[it->second - 1]->public_key);
  }
  if (!bound.empty()) {
    if (std::find(bound.begin(), bound.end(), key) != bound.end()) return {};
    return fmt::format("{} linked from {}, but that name is bound here to key {} (allowed_peers or add_peer)", who, from,
                       bound.front());
  }
  const auto it = e_.pinned_names.find(name);
  if (it != e_.pinned_names.end()) {
    if (it->second == key) return {};
    return fmt::format("{} linked from {}, but that name is bound here to key {} (the first that linked under it; "
                       "allow(\"{}=KEY\") binds it to another): refused, and the links of the engine that holds the "
                       "name are untouched",
                       who, from, it->second, name);
  }
  if (key.empty()) return {};
  // One key may hold a few names (an engine restarted under another), not the table: a key
  // holder that makes up names by the thousand is refused rather than let in unpinned.
  std::uint32_t& held = e_.names_of_key[key];
  if (held >= Engine::Impl::kNamesPerKey || e_.pinned_names.size() >= Engine::Impl::kMaxPeers) {
    note = fmt::format("engine {}: refused '{}' from {}: its key holds {} names here already (at most {}), or {} "
                       "names are pinned (the most kept)",
                       e_.name, name, from, held, Engine::Impl::kNamesPerKey, e_.pinned_names.size());
    return fmt::format("{}: its key holds {} names at engine '{}' already (at most {})", who, held, e_.name,
                       Engine::Impl::kNamesPerKey);
  }
  ++held;
  e_.pinned_names.emplace(name, key);
  return {};
}

void Worker::refuse(Link& l, const std::string& why) {
  send(l, ew::refuse(why));  // ahead of the BYE that closing queues behind it
  break_link(l, why);
}

void Worker::revoke(const std::string& entry) {
  {
    // allow() may have come since revoke() posted this: then nothing is revoked.
    std::lock_guard lock(e_.mu);
    if (std::find(e_.revoked.begin(), e_.revoked.end(), entry) == e_.revoked.end()) return;
  }
  for (auto& o : links_) {
    Link& l = *o;
    if (l.initiated || l.state == Link::State::closing || !l.ident_seen || !matches(entry, l.peer_name, l.peer_key)) {
      continue;
    }
    // Its keys die first (deallocating a window invalidates it), then the link goes: nothing it
    // has in flight, or posts before it sees the close, reaches a segment.
    l.binds_waiting.clear();
    for (auto it = l.windows.begin(); it != l.windows.end();) {
      if (!(*it)->bound && (*it)->mw) {
        (*it)->segment.clear();  // its bind completes (or flushes) first; then it goes
        ++it;
      } else {
        it = l.windows.erase(it);
      }
    }
    refuse(l, fmt::format("'{}' was revoked by engine '{}' (Engine::revoke(\"{}\")): it is not served until "
                          "allow(\"{}\")",
                          l.peer_name, e_.name, entry, entry));
  }
}

void Worker::wrong_engine(Link& l, const std::string& why) {
  Peer& p = *l.peer;
  if (l.rail != nullptr && l.rail != p.rails[0].get()) {
    l.rail->wanted = false;  // not probed again: the peer's next RAILS says what it offers
    return break_link(l, why);
  }
  // Not the peer: nothing waits for this link (no transfer goes to the wrong engine), connect()
  // ends with why, and the next transfer to the peer tries again.
  fail_waiting(p, TransferStatus::connect_failed, why);
  break_link(l, why);
  not_linked(p, why);
}

}  // namespace rdmakit::detail
