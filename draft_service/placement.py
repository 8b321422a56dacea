"""Where a draft's sequences go when it has several verifiers: the `--verifier` list (or the DNS name that stands for
one), and the choice of a verifier for a new or a moved sequence, by the prefixes each one caches and by load.

A sequence stays on the verifier it was placed on (its KV lives there) until that verifier goes (its stream
breaks, or it drains); then it is placed again, with all its tokens, on another one.
"""

from __future__ import annotations

import asyncio
import socket
from collections import OrderedDict
from dataclasses import dataclass, field

PREFIX_CHUNK_TOKENS = 16  # prompts are hashed by chunks of this many tokens, each hash chained to the last
MAX_PREFIX_ENTRIES = 1 << 16  # chunk hashes remembered per verifier (least recently placed dropped first)
# A cached prefix decides the placement when it covers at least this many tokens and half the prompt ...
MIN_PREFIX_TOKENS = 32
# ... unless that verifier is this much busier than the least loaded one (both conditions, as SGLang's router):
BALANCE_ABS = 16  # sequences more
BALANCE_REL = 1.5  # times as many
KV_FULL = 0.95  # a verifier whose KV pool is this full takes a new sequence only when all others are as full
DNS_SCHEME = "dns:///"


@dataclass(frozen=True)
class VerifierTargets:
    """`--verifier`: HOST:PORT[,HOST:PORT...], or dns:///NAME:PORT, a name that resolves to every verifier's
    address (a Kubernetes headless Service does) and is resolved again while the draft runs."""

    addresses: tuple[str, ...] = ()
    dns_host: str | None = None
    dns_port: int = 0

    @classmethod
    def parse(cls, text: str) -> VerifierTargets:
        text = text.strip()
        if text.startswith(DNS_SCHEME):
            host, port = _host_port(text[len(DNS_SCHEME):], text)
            return cls(dns_host=host, dns_port=port)
        addresses = tuple(a.strip() for a in text.split(",") if a.strip())
        if not addresses:
            raise ValueError("verifier must be HOST:PORT, a comma-separated list of them, or dns:///NAME:PORT")
        for address in addresses:
            _host_port(address, text)
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"verifier lists an address twice: {text!r}")
        return cls(addresses=addresses)

    @property
    def resolves(self) -> bool:
        return self.dns_host is not None

    async def resolve(self) -> tuple[str, ...]:
        """The addresses now: the list as given, or what the name resolves to (IPv6 in brackets), sorted."""
        if self.dns_host is None:
            return self.addresses
        infos = await asyncio.get_running_loop().getaddrinfo(self.dns_host, self.dns_port, type=socket.SOCK_STREAM)
        found = set()
        for family, _, _, _, sockaddr in infos:
            ip = sockaddr[0]
            found.add(f"[{ip}]:{self.dns_port}" if family == socket.AF_INET6 else f"{ip}:{self.dns_port}")
        return tuple(sorted(found))


def _host_port(address: str, whole: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"verifier must be HOST:PORT, a comma-separated list of them, or dns:///NAME:PORT; "
                         f"got {whole!r}")
    return host, int(port)


def prefix_hashes(token_ids: list[int] | tuple[int, ...], salt: str | None) -> list[int]:
    """One hash per full chunk of PREFIX_CHUNK_TOKENS tokens, each over everything before it too (and the
    request's cache salt: the verifier shares cached blocks only within one salt)."""
    hashes = []
    h = hash(("specwire-prefix", salt))
    for end in range(PREFIX_CHUNK_TOKENS, len(token_ids) + 1, PREFIX_CHUNK_TOKENS):
        h = hash((h, tuple(token_ids[end - PREFIX_CHUNK_TOKENS:end])))
        hashes.append(h)
    return hashes


@dataclass
class VerifierLoad:
    """A verifier's last load report (VerifierLoad on the wire)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0


@dataclass
class VerifierState:
    """What the draft knows of one verifier, for placement."""

    address: str
    load: VerifierLoad | None = None  # None: no report yet (or an older verifier, which sends none)
    draining: bool = False
    gone: bool = False  # no longer in what the name resolves to
    num_sequences: int = 0  # this draft's sequences on it
    # sequences placed here that it has not answered yet: a report may predate their opens (it is sent every
    # LOAD_REPORT_INTERVAL_S), so they count on top of it until their first reply, after which every report
    # counts them (the stream keeps order); counting them only until the next report lost them under a burst of
    # opens, and the burst piled onto one verifier
    unanswered: set[int] = field(default_factory=set)
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def reported(self, load: VerifierLoad, draining: bool) -> None:
        self.load, self.draining = load, draining

    def reset(self) -> None:
        """A new stream to it: what an earlier one reported is stale (a restarted verifier caches nothing). A
        draining flag stays until the new stream's first report (sent right after its welcome) clears it: a
        verifier reconnected to while it drains takes no sequence meanwhile."""
        self.load = None
        self.unanswered.clear()
        self.prefixes.clear()

    @property
    def busy(self) -> int:
        """Sequences it serves or queues, as best known now."""
        if self.load is None:
            return self.num_sequences
        return self.load.num_running + 2 * self.load.num_waiting + len(self.unanswered)

    @property
    def kv_full(self) -> bool:
        return self.load is not None and self.load.kv_cache_usage >= KV_FULL

    def cached_chunks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.prefixes:
                break
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > MAX_PREFIX_ENTRIES:
            self.prefixes.popitem(last=False)

    def answered(self, seq_id: int) -> None:
        """The verifier replied about the sequence (or it left): its reports from now on count it."""
        self.unanswered.discard(seq_id)

    def placed(self, seq_id: int, hashes: list[int]) -> None:
        self.unanswered.add(seq_id)
        self.remember(hashes)


def choose(candidates: list[VerifierState], hashes: list[int], num_tokens: int) -> tuple[VerifierState, str]:
    """The verifier for a sequence of `num_tokens` tokens with these prefix hashes, and why ("prefix" or "load").
    Least loaded first: the fewest sequences (a queued one counts twice), a pool that is not full, the most free
    blocks; a verifier that caches a long prefix of the prompt wins unless it is far busier."""
    assert candidates
    least = min(candidates, key=lambda v: (v.kv_full, v.busy, v.num_sequences,
                                           -(v.load.num_free_blocks if v.load else 0)))
    best = max(candidates, key=lambda v: (v.cached_chunks(hashes), -v.busy))
    cached_tokens = best.cached_chunks(hashes) * PREFIX_CHUNK_TOKENS
    if best is not least and cached_tokens >= max(MIN_PREFIX_TOKENS, num_tokens // 2) and not best.kv_full:
        imbalanced = best.busy - least.busy > BALANCE_ABS and best.busy > BALANCE_REL * least.busy
        if not imbalanced:
            return best, "prefix"
    if best is least and cached_tokens >= max(MIN_PREFIX_TOKENS, num_tokens // 2):
        return least, "prefix"
    return least, "load"
