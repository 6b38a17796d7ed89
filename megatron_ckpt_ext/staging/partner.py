"""Partner copies (``--ckpt-memory-partner``): each rank's sealed snapshot is copied, once sealed,
into the shared memory of a rank on another node (its partner), so that a job restarted after
losing a node still restores from memory: before the memory tier looks for its seal
(load/memory.py), a rank whose node holds none fetches its snapshot back from the node that holds
its copy (:meth:`PartnerLink.reseed`).

A node is a (host, shared-memory directory) pair, so on one host two stagers with directories of
their own stand for two nodes. The partner of rank r is the rank of the next node (nodes in the
order of their lowest rank) at r's index on its own node (modulo that node's ranks); with one node
there is none and nothing is copied.

Transport: TCP between the ranks' hosts, one connection per copy or fetch: a length-prefixed JSON
header, then every buffer's bytes (``socket.sendfile`` from the segment). The receiver writes
them into segments of its own, sums each buffer as it arrives, and seals the copy
(``mcxseal_<root hash>_<rank>.replica.json``, beside the node's own seals, so the orphan sweep,
the age bound, ``shm list`` and ``shm clean`` treat it as a seal) only if every sum is the one
sealed at the source: a copy cut short or changed on the way (the next save staging into the
buffers) is never sealed. A node holds one copy per partnered rank: the old one is removed when a
new one starts to arrive. Every request carries the serving rank's token (exchanged with the
addresses), so no other job's ranks are served.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any, Callable, Sequence

from .partner_wire import (PartnerError, advertised_host, background_priority, receive_file,
                           recv_json, send_entries, send_json)
from .retained import Seal, SealEntry, discard, read_seal, seal_path, write_seal
from .segments import _segment_path, _unlink, is_mapped

__all__ = ["PartnerLink", "partner_link", "partners", "replica_path"]

logger = logging.getLogger(__name__)

REPLICA_TAIL = ".replica.json"
_SOCKET_TIMEOUT_S = 60.0  # a peer that stops sending or reading mid-copy
_FETCH_STREAMS = 4  # connections a restart's fetch uses at once


def partner_link(stager: Any) -> PartnerLink:
    """The link of a shared-memory stager (its directory, rank, job and counters), which then
    hands it every seal it writes."""
    link = PartnerLink(stager.shm_dir, stager.rank, job_id=stager.job_id, stats=stager.stats)
    stager.partner = link
    return link


def partners(nodes: Sequence[str]) -> dict[int, int]:
    """{rank: its partner} for the ranks whose node is ``nodes[rank]``; empty with one node."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        if node not in members:
            order.append(node)
            members[node] = []
        members[node].append(r)
    if len(order) < 2:
        return {}
    out = {}
    for i, node in enumerate(order):
        following = members[order[(i + 1) % len(order)]]
        for j, r in enumerate(members[node]):
            out[r] = following[j % len(following)]
    return out


def replica_path(shm_dir: str, root: str | os.PathLike[str], rank: int) -> str:
    """Where this node keeps its copy of ``rank``'s snapshot of ``root``."""
    return seal_path(shm_dir, root, rank)[:-len(".json")] + REPLICA_TAIL


def node_id(shm_dir: str) -> str:
    return f"{socket.gethostname()}:{os.path.realpath(shm_dir)}"


class PartnerLink:
    """One rank's end: a server that receives the copies this node holds for other ranks (and
    serves them back at a restart), and a sender thread that copies this rank's newest seal to
    its partner. ``stats`` (the stager's counters) gets ``partner_*`` figures."""

    def __init__(self, shm_dir: str, rank: int, *, job_id: str, stats: dict | None = None) -> None:
        self.shm_dir, self.rank, self.job_id = shm_dir, rank, job_id
        self.node = node_id(shm_dir)
        self.token = os.urandom(16).hex()
        self.stats = stats if stats is not None else {}
        self.book: dict[int, tuple[str, str, int, str]] | None = None  # rank: node, host, port, token
        self.partner: int | None = None
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._wake = threading.Condition()
        self._pending: tuple[Seal, threading.Event] | None = None
        self._sending = False
        self._warned = False  # the first failed copy is a warning, later ones debug lines
        self._roots: set[str] = set()  # the save roots whose copies this node may hold
        self.host, self.port = advertised_host(), 0

    # -- set-up ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Listen (idempotent); the address is exchanged by :meth:`connect` or :meth:`reseed`."""
        if self._server is not None:
            return
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("", 0))
        server.listen(16)
        server.settimeout(0.2)
        self._server, self.port = server, server.getsockname()[1]
        self._spawn(self._serve, "mcx-partner-serve")
        self._spawn(self._send_loop, "mcx-partner-send")

    def connect(self, gather: Callable[[Any], list[Any]]) -> None:
        """Collective, once: every rank's address, and this rank's partner."""
        self.start()
        self._set_book(gather((self.rank, self.node, self.host, self.port, self.token)))
        if self.partner is None and self.rank == min(self.book or {0: None}):
            logger.info("--ckpt-memory-partner: every rank is on one node (%s): no partner "
                        "copies are made", self.node)

    def _set_book(self, views: list) -> None:
        self.book = {v[0]: (v[1], v[2], v[3], v[4]) for v in views}
        ranks = sorted(self.book)
        mapping = partners([self.book[r][0] for r in ranks])
        mine = ranks.index(self.rank)
        self.partner = ranks[mapping[mine]] if mine in mapping else None

    # -- the copy after each seal ----------------------------------------------------------------
    def replicate(self, seal: Seal, cancel: threading.Event) -> None:
        """Copy ``seal``'s snapshot to the partner in the background (the newest seal wins; a
        copy under way stops when ``cancel`` is set: its buffers are about to change)."""
        if self.partner is None or self.book is None:
            return
        self._roots.add(seal.root)
        with self._wake:
            self._pending = (seal, cancel)
            self._wake.notify()

    def _send_loop(self) -> None:
        background_priority()  # training first: a copy may take longer on a busy host
        while not self._stop.is_set():
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None or self._stop.is_set())
                job, self._pending = self._pending, None
                self._sending = job is not None
            if job is None:
                continue
            seal, cancel = job
            t0 = time.perf_counter()
            try:
                self._put(seal, lambda: cancel.is_set() or self._stop.is_set())
            except (OSError, PartnerError, ValueError) as e:
                self.stats["partner_failures"] = self.stats.get("partner_failures", 0) + 1
                self.stats["partner_last_error"] = str(e)
                quiet = cancel.is_set() or self._stop.is_set() or self._warned
                self._warned = self._warned or not quiet
                (logger.debug if quiet else logger.warning)(
                    "rank %d: the partner copy of iteration %d was not made (a restart after "
                    "losing this node reads storage; further failures are debug lines; "
                    "counters: staging_stats()['partner_failures']): %s", self.rank,
                    seal.iteration, e)
                continue
            finally:
                self._sending = False
            seconds = time.perf_counter() - t0
            self.stats["partner_copies"] = self.stats.get("partner_copies", 0) + 1
            self.stats["partner_bytes"] = seal.nbytes
            self.stats["partner_copy_s"] = round(seconds, 6)
            self.stats["partner_iteration"] = seal.iteration

    def _put(self, seal: Seal, cancel: Callable[[], bool]) -> None:
        node, host, port, token = self.book[self.partner]  # type: ignore[index]
        with socket.create_connection((host, port), timeout=_SOCKET_TIMEOUT_S) as sock:
            send_json(sock, {"op": "put", "token": token, "from": self.node,
                              "seal": _seal_dict(seal)})
            reply = recv_json(sock)  # the partner takes it, or says why not, before the bytes
            if reply.get("ready"):
                send_entries(sock, seal.entries, cancel)
                reply = recv_json(sock)
        if not reply.get("ok"):
            raise PartnerError(f"{node} refused it: {reply.get('why')}")

    # -- a restart -------------------------------------------------------------------------------
    def reseed(self, *, root: str, iteration: int, world: int,
               gather: Callable[[Any], list[Any]], detail: dict | None = None) -> None:
        """Collective, before the memory tier looks for this rank's seal of ``root``: every rank
        says what it holds; a rank whose node holds no seal of ``iteration`` fetches its copy from
        the node holding it, if any, and seals it here as its own (checked again by the memory
        tier like any seal). Rank 0 says in one line which ranks fetched and how it went.
        ``detail`` gets this rank's ``partner_fetch``."""
        self.start()
        root = os.path.realpath(root)
        self._roots.add(root)
        own = read_seal(seal_path(self.shm_dir, root, self.rank))
        has = own is not None and own.iteration == iteration and own.world == world
        held = {}
        for path in self._replica_files(root):
            copy = read_seal(path)
            if copy is not None and copy.world == world:
                held[copy.rank] = copy.iteration
        views = gather((self.rank, self.node, self.host, self.port, self.token, has, held))
        self._set_book(views)
        need = {v[0]: [u[0] for u in views if u[1] != v[1] and u[6].get(v[0]) == iteration]
                for v in views if not v[5]}
        if not need or not all(need.values()):
            return  # every rank holds its seal, or one has no copy anywhere: all read storage
        result: dict[str, Any] = {}
        holders = need.get(self.rank)
        if holders:
            result = self._fetch(holders[0], root, iteration, own)
            if detail is not None:
                detail["partner_fetch"] = result
        results = gather((self.rank, result))
        if self.rank == views[0][0]:
            done = [(r, x) for r, x in results if x]
            logger.info("checkpoint iteration %d: %s", iteration, "; ".join(
                f"rank {r} fetched its snapshot from its partner copy on {x['from']} "
                f"({x['bytes'] / 1e9:.2f} GB in {x['seconds']:.2f} s)" if x.get("ok")
                else f"rank {r} could not fetch its partner copy ({x.get('why')})"
                for r, x in done))

    def _fetch(self, holder: int, root: str, iteration: int, own: Seal | None) -> dict:
        """This rank's copy from ``holder``'s node: its seal first, then its buffers over
        :data:`_FETCH_STREAMS` connections at once (a restart waits for them; one stream is
        bound by writing the segments, ~2 GB/s a core), sealed here as this rank's own."""
        node = self.book[holder][0]  # type: ignore[index]
        t0 = time.perf_counter()
        made: list[str] = []
        try:
            seal, _ = self._get(holder, root, iteration, [])
            if own is not None:  # another iteration's: replaced by the one fetched
                discard(own, is_mapped=is_mapped)
            groups = _split([e.nbytes for e in seal.entries], _FETCH_STREAMS)
            entries: list[SealEntry | None] = [None] * len(seal.entries)
            with ThreadPoolExecutor(max_workers=len(groups) or 1) as pool:
                runs = [pool.submit(self._get, holder, root, iteration, g, seal.generation,
                                    made) for g in groups]
                for group, run in zip(groups, runs):
                    for i, entry in zip(group, run.result()[1]):
                        entries[i] = entry
            seal = replace(seal, entries=entries, file="", replica_of="")
            write_seal(seal, self.shm_dir)
        except (OSError, PartnerError, ValueError) as e:
            for path in made:
                _unlink(path)
            return {"ok": False, "from": node, "why": str(e)}
        return {"ok": True, "from": node, "bytes": seal.nbytes,
                "seconds": round(time.perf_counter() - t0, 6)}

    def _get(self, holder: int, root: str, iteration: int, indices: list[int],
             generation: str | None = None,
             made: list[str] | None = None) -> tuple[Seal, list[SealEntry]]:
        """One connection to ``holder``: the copy's seal and the buffers at ``indices``,
        received into new segments (their paths added to ``made``)."""
        _, host, port, token = self.book[holder]  # type: ignore[index]
        with socket.create_connection((host, port), timeout=_SOCKET_TIMEOUT_S) as sock:
            send_json(sock, {"op": "get", "token": token, "root": root, "rank": self.rank,
                             "iteration": iteration, "entries": indices})
            reply = recv_json(sock)
            if "seal" not in reply:
                raise PartnerError(str(reply.get("why")))
            seal = _seal_from(reply["seal"])
            if generation is not None and seal.generation != generation:
                raise PartnerError("the copy was replaced while it was fetched")
            wanted = [seal.entries[i] for i in indices]
            return seal, self._receive_entries(sock, wanted, self.job_id, self.rank,
                                               made if made is not None else [])

    # -- the server ------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()  # type: ignore[union-attr]
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                return  # closed
            self._spawn(self._handle, "mcx-partner-conn", conn)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_SOCKET_TIMEOUT_S)
            try:
                request = recv_json(conn)
                if request.get("token") != self.token:
                    send_json(conn, {"ok": False, "why": "not this job's token"})
                elif request.get("op") == "put":
                    seal = _seal_from(request["seal"])
                    why = self._make_room(seal)  # said before any byte comes
                    send_json(conn, {"ok": False, "why": why} if why else {"ready": True})
                    if not why:
                        send_json(conn, self._take_copy(conn, request, seal))
                elif request.get("op") == "get":
                    self._give_copy(conn, request)
            except (OSError, PartnerError, ValueError, LookupError, TypeError,
                    AttributeError) as e:  # whatever a peer sent: this request ends, not the server
                logger.debug("rank %d: a partner request failed: %s", self.rank, e)

    def _make_room(self, seal: Seal) -> str:
        """Before a copy of ``seal`` arrives: the node's previous copy of that rank removed (one
        copy per rank); why it cannot be taken ('' if it can): the shared memory's free room."""
        old = read_seal(replica_path(self.shm_dir, seal.root, seal.rank))
        if old is not None:
            discard(old, is_mapped=is_mapped)
        fs = os.statvfs(self.shm_dir)
        free = fs.f_bavail * fs.f_frsize
        if free < seal.nbytes:
            return (f"{self.shm_dir} on {self.node.split(':')[0]} has {free / 1e9:.2f} GB free, "
                    f"the copy needs {seal.nbytes / 1e9:.2f} GB")
        return ""

    def _take_copy(self, conn: socket.socket, request: dict, seal: Seal) -> dict:
        background_priority()  # (this connection's thread; a fetch at a restart keeps its own)
        target = replica_path(self.shm_dir, seal.root, seal.rank)
        made: list[str] = []
        try:
            entries = self._receive_entries(conn, seal.entries, f"{self.job_id}copy", seal.rank,
                                            made)
            copy = replace(seal, entries=entries, file="", replica_of=request.get("from", ""))
            write_seal(copy, self.shm_dir, path=target)  # /dev/shm full: no unsealed copy kept
        except (OSError, PartnerError) as e:
            for path in made:
                _unlink(path)
            return {"ok": False, "why": str(e)}
        self._roots.add(seal.root)
        return {"ok": True}

    def _give_copy(self, conn: socket.socket, request: dict) -> None:
        copy = read_seal(replica_path(self.shm_dir, request["root"], request["rank"]))
        if copy is None or copy.iteration != request["iteration"]:
            held = None if copy is None else copy.iteration
            send_json(conn, {"why": f"{self.node} holds iteration {held} of rank "
                                     f"{request['rank']}, not {request['iteration']}"})
            return
        send_json(conn, {"seal": _seal_dict(copy)})
        send_entries(conn, [copy.entries[i] for i in request["entries"]], self._stop.is_set)

    def _receive_entries(self, sock: socket.socket, entries: list[SealEntry], job: str,
                         rank: int, made: list[str]) -> list[SealEntry]:
        out = []
        for e in entries:
            if e.path is None:
                out.append(e)
                continue
            path = _segment_path(self.shm_dir, job, rank)
            made.append(path)
            crc = receive_file(sock, path, e.nbytes)
            if crc != e.crc32:
                raise PartnerError(f"{e.key}: CRC-32 {crc:#x} on arrival, sealed {e.crc32:#x}")
            out.append(replace(e, path=path))
        return out

    def _replica_files(self, root: str) -> list[str]:
        prefix = os.path.basename(seal_path(self.shm_dir, root, 0)).rsplit("_", 1)[0] + "_"
        try:
            names = os.listdir(self.shm_dir)
        except OSError:
            return []
        return [os.path.join(self.shm_dir, n) for n in names
                if n.startswith(prefix) and n.endswith(REPLICA_TAIL)]

    # -- the end ---------------------------------------------------------------------------------
    def close(self, *, keep: bool = False) -> None:
        """Stop serving and sending; unless ``keep`` (the same rule as the rank's own snapshot
        at close), the copies this node holds of the save roots this link saved, loaded or
        received (also those an earlier, killed run left) are removed. ``keep`` lets the copy of
        this rank's last seal finish first (at most the socket timeout)."""
        deadline = time.monotonic() + _SOCKET_TIMEOUT_S
        while keep and (self._pending is not None or self._sending) and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        with self._wake:
            self._pending = None
            self._wake.notify_all()
        if self._server is not None:
            self._server.close()
        for t in self._threads:
            t.join(timeout=5)
        if not keep:
            for root in self._roots:
                for path in self._replica_files(root):
                    copy = read_seal(path)
                    if copy is not None:
                        discard(copy, is_mapped=is_mapped)
        self._roots.clear()

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]


def _split(sizes: list[int], parts: int) -> list[list[int]]:
    """The indices of ``sizes`` in at most ``parts`` groups of about equal bytes (largest
    first to the lightest group), each in index order; empty groups left out."""
    groups: list[list[int]] = [[] for _ in range(max(1, parts))]
    load = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += sizes[i]
    return [sorted(g) for g in groups if g]


def _seal_dict(seal: Seal) -> dict:
    return {k: v for k, v in asdict(seal).items() if k != "file"}


def _seal_from(data: dict) -> Seal:
    data = dict(data)
    entries = [SealEntry(**e) for e in data.pop("entries")]
    data.pop("file", None)
    return Seal(entries=entries, **data)
