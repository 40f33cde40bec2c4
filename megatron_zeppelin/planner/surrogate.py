"""A closed-form stand-in for the replay's step time, certified against it.

The replay (``sim/replay.py``) runs every op of the step's schedule; building
that schedule costs far more than a planner may spend per candidate.  This
module computes, from a :class:`~megatron_zeppelin.plan.Plan` alone and in
numpy over its rings, groups and ranks, what the replay executes:

* per rank and pass the compute lane's work: local sequences, every ring
  step's kernel (zigzag chunk rows, ``CostModel.attn_s`` at the step's block
  length) and Ulysses shares, the linear work (``CostModel.linear_s``);
* a ring as its chain of steps: step ``s``'s kernel on position ``j`` waits for
  the K/V that travelled ``s`` links (backward: K/V and the dK/dV one step
  behind share the sender's port), each link priced on the port it uses
  (NVLink, the sender's NIC, or the routing layer's dispatch / NIC / combine
  legs), slowed by the other traffic of the segment on the same ports (a port
  serves one transfer at a time);
* Ulysses groups as all-to-all in, kernel, all-to-all out, and layout switches
  as all-to-alls: a rank leaves once its busiest port drained;
* the segments chained per rank as the replay chains them (a rank enters a
  segment when its part of the previous one is done; a ring or group starts
  once all its ranks entered), for ``m`` and ``m - 1`` layers extrapolated as
  ``replay_step`` extrapolates, plus the gradient sync tail
  (``cost/step_sync.py``).

Every constant is the cost model's; nothing is fitted.  ``benchmarks/surrogate_error.py``
measures how far it is from the replay (``docs/results/surrogate.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.cost.model import ATTN_BWD_RATIO, LINEAR_BWD_RATIO, CostModel
from megatron_zeppelin.cost.step_sync import forward_backward_split, step_sync
from megatron_zeppelin.plan import Mode, Plan
from megatron_zeppelin.schedule.routing import min_routed_bytes

#: Layers the replay runs before it extrapolates (``sim/replay.py: REPLAYED_LAYERS``).
REPLAYED_LAYERS = 4
#: Query rows per local kernel call the schedule packs short sequences into (``AttnShape``).
PASSES = (False, True)


@dataclass
class _Segment:
    """One engine call of one pass, per rank: what it costs once every rank has entered."""

    work: np.ndarray
    """Seconds of compute-lane work per rank."""
    chains: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Coupled groups: (member ranks flat, group id per member, seconds from the
    group's start to the member's exit)."""
    alltoall: np.ndarray | None = None
    """Per rank the seconds its busiest port needs (a layout switch), else None."""


class StepSurrogate:
    """The step time of plans under one cost model (see the module docstring)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        c, m = cost.cluster, cost.model
        topo = c.topology
        self.gpn, self.nics = topo.gpus_per_node, topo.nics_per_node
        self.affinity = np.asarray(topo.nic_affinity, np.int64)
        self.layers = m.num_layers
        g = c.gpu
        # attn_s(pairs, block) = pairs * per_pair * (block + half) / block, per layer and pass below.
        self.per_pair = m.attn_flops_per_pair * (1 + ATTN_BWD_RATIO) / (g.peak_tflops * 1e12 * g.attn_efficiency)
        self.half = g.attn_half_block
        self.attn_share = {False: 1.0 / ((1 + ATTN_BWD_RATIO) * m.num_layers),
                           True: ATTN_BWD_RATIO / ((1 + ATTN_BWD_RATIO) * m.num_layers)}
        self.lin_share = {False: 1.0 / ((1 + LINEAR_BWD_RATIO) * m.num_layers),
                          True: LINEAR_BWD_RATIO / ((1 + LINEAR_BWD_RATIO) * m.num_layers)}
        self.kv_numel = m.num_query_groups * m.head_dim
        self.isz, self.acc = m.dtype_bytes, 4
        self.q_heads, self.kv_heads, self.head_dim = m.num_attention_heads, m.num_query_groups, m.head_dim
        self.row_bytes = m.hidden_size * m.dtype_bytes
        self.nvl, self.nic = c.nvlink, c.nic
        self.threshold = min_routed_bytes(cost) if cost.routing else math.inf

    # ----------------------------------------------------------------- links
    def _attn_s(self, pairs: np.ndarray, block: np.ndarray) -> np.ndarray:
        block = np.maximum(block, 1)
        return np.where(pairs > 0, pairs * self.per_pair * (block + self.half) / block, 0.0)

    def _ports(self, src: np.ndarray, dst: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(same node, egress port, ingress port) of direct transfers, numbered as the replay numbers them."""
        g = self.gpn
        inside = src // g == dst // g
        out = np.where(inside, 2 * src, 2 * world + 2 * ((src // g) * self.nics + self.affinity[src % g]))
        inn = np.where(inside, 2 * dst + 1, 2 * world + 2 * ((dst // g) * self.nics + self.affinity[dst % g]) + 1)
        return inside, out, inn

    def _transfers(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, w: int,
                   routed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Messages from ``src`` to ``dst``: (seconds of each alone, the seconds of
        one piece's NIC leg when it is routed (else 0), and its legs as message
        index, port, seconds the leg holds the port).  Routed messages
        (across nodes, at least the break-even) go in ``P`` pieces: dispatched over
        the sender's NVLink one after another, each over NIC ``j``, combined into
        the receiver; proxies and peers forward them (spread over the node's GPUs)."""
        inside, out, inn = self._ports(src, dst, w)
        nvl = self.nvl.latency_us * 1e-6 + nbytes / (self.nvl.bandwidth_GBps * 1e9)
        nic = self.nic.latency_us * 1e-6 + nbytes / (self.nic.bandwidth_GBps * 1e9)
        seconds = np.where(inside, nvl, nic)
        ids = np.arange(len(src))
        route = ~inside & (nbytes >= self.threshold) if routed and self.nics > 1 else np.zeros(len(src), bool)
        direct = ~route
        legs = [(ids[direct], out[direct], seconds[direct]), (ids[direct], inn[direct], seconds[direct])]
        if route.any():
            P, g = self.nics, self.gpn
            piece = nbytes[route] / P
            d = self.nvl.latency_us * 1e-6 + piece / (self.nvl.bandwidth_GBps * 1e9)
            n = self.nic.latency_us * 1e-6 + piece / (self.nic.bandwidth_GBps * 1e9)
            seconds[route] = P * d + n
            i, s, t = ids[route], src[route], dst[route]
            legs += [(i, 2 * s, (P - 1) * d), (i, 2 * t + 1, (P - 1) * d)]
            for j in range(P):
                legs += [(i, 2 * w + 2 * ((s // g) * P + j), n), (i, 2 * w + 2 * ((t // g) * P + j) + 1, n)]
            spread = d * (P - 1) / g
            for local in range(g):
                legs += [(i, 2 * ((s // g) * g + local) + 1, spread), (i, 2 * ((t // g) * g + local), spread)]
        msg, port, sec = (np.concatenate(x) for x in zip(*legs))
        piece_s = np.zeros(len(src))
        if route.any():
            piece_s[route] = n
        return seconds, piece_s, msg, port, sec

    @staticmethod
    def _drain(group: np.ndarray, port: np.ndarray, total: np.ndarray, groups: int) -> np.ndarray:
        """Per group, when the busiest port it uses has carried the segment's
        whole traffic (a port serves one transfer at a time)."""
        out = np.zeros(groups)
        if len(port):
            np.maximum.at(out, group, total[port])
        return out

    # ----------------------------------------------------------- attention
    def _attention(self, plan: Plan, backward: bool, routed: bool) -> _Segment:
        w = plan.world_size
        share = self.attn_share[backward]
        work = np.zeros(w)
        load = np.zeros(2 * w + 2 * (w // self.gpn + 1) * self.nics)
        local_rank, local_len, rings, groups = [], [], {}, []
        lens = plan.seq_lens
        for p in plan.attention:
            if p.mode is Mode.LOCAL:
                local_rank.append(p.ranks[0])
                local_len.append(lens[p.seq])
            elif p.mode is Mode.RING:
                rings.setdefault(p.size, []).append((p.ranks, lens[p.seq]))
            else:
                groups.append((p.ranks, lens[p.seq]))
        if local_len:
            L = np.asarray(local_len, np.float64)
            np.add.at(work, np.asarray(local_rank), self._attn_s(L * (L + 1) / 2, L) * share)
        pending = [self._rings(k, members, backward, routed, work, load, w) for k, members in rings.items()]
        pending += [self._ulysses(groups, backward, work, load, w)] if groups else []
        chains = [finish(load) for finish in pending]
        return _Segment(work, chains)

    def _rings(self, k: int, members: list, backward: bool, routed: bool, work: np.ndarray, load: np.ndarray,
               w: int):
        """Rings of ``k`` ranks: adds their kernels to ``work`` and their messages
        to ``load``; returns the function that, given the segment's port loads,
        yields each position's seconds from the ring's start to its exit."""
        share = self.attn_share[backward]
        ranks = np.asarray([r for r, _ in members], np.int64)            # (n, k)
        L = np.asarray([n for _, n in members], np.int64)
        # Zigzag chunk rows: position i holds chunks i and 2k-1-i.
        bounds = (np.arange(2 * k + 1)[None, :] * L[:, None]) // (2 * k)
        sizes = np.diff(bounds, axis=1)
        a, b = sizes[:, :k].astype(np.float64), sizes[:, ::-1][:, :k].astype(np.float64)
        pos = np.arange(k)
        step = np.arange(k)
        owner = (pos[:, None] - step[None, :]) % k                          # (k pos, k step)
        ap, bp = a[:, :, None], b[:, :, None]
        ao, bo = a[:, owner], b[:, owner]
        earlier = (owner < pos[:, None])[None]
        later = (owner > pos[:, None])[None]
        pairs = np.where(earlier, (ap + bp) * ao, np.where(later, bp * (ao + bo),
                                                             ap * (ap + 1) / 2 + bp * ap + bp * (bp + 1) / 2))
        block = np.where(earlier, ap + bp, np.where(later, bp, np.floor((ap + 2 * bp) / 3)))
        comp = self._attn_s(pairs, block) * share                           # (n, pos, step)
        np.add.at(work, ranks.ravel(), comp.sum(axis=2).ravel())
        # Messages of step s on link j -> j+1: the K/V of owner (j - s) % k, and
        # backward the dK/dV of owner (j - s + 1) % k one step behind.
        n = len(L)
        shard = a + b
        nxt = np.roll(ranks, -1, axis=1)
        x = np.zeros((n, k, k))
        via = np.zeros((n, k, k))           # a routed message's NIC leg of one piece
        leg_ring, leg_port, leg_sec = [], [], []

        def send(nbytes: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
            shape = nbytes.shape
            src = np.broadcast_to(ranks[:, :, None], shape).ravel()
            dst = np.broadcast_to(nxt[:, :, None], shape).ravel()
            sec, piece, msg, port, held = self._transfers(src, dst, nbytes.ravel() * self.kv_numel * itemsize,
                                                          w, routed)
            leg_ring.append(msg // (shape[1] * shape[2]))
            leg_port.append(port)
            leg_sec.append(held)
            return sec.reshape(shape), piece.reshape(shape)

        dkv_last = np.zeros(n)
        if k > 1:
            x[:, :, :k - 1], via[:, :, :k - 1] = send(2 * shard[:, owner[:, :k - 1]], self.isz)
            if backward:
                # dK/dV of steps 1..k (owner (j - s + 1) % k); step k hands each owner its own.
                dkv, dvia = send(2 * shard[:, (pos[:, None] - np.arange(1, k + 1)[None, :] + 1) % k], self.acc)
                x[:, :, 1:] += dkv[:, :, :k - 1]       # shares the sender's port with the next K/V
                via[:, :, 1:] += dvia[:, :, :k - 1]
                dkv_last = dkv[:, :, k - 1].max(axis=1)
        # Rings over the same ranks share every link and lane step by step: one chain.
        tuples, of = np.unique(ranks, axis=0, return_inverse=True)
        of = of.reshape(-1)
        G = len(tuples)

        def summed(v: np.ndarray) -> np.ndarray:
            out = np.zeros((G,) + v.shape[1:])
            np.add.at(out, of, v)
            return out

        xs, vias, last = summed(x), summed(via), summed(dkv_last)
        # A routed piece is forwarded by GPUs whose send lanes post in message
        # order: the next crossing's sender combines a piece of the previous
        # crossing before it posts its own, so a step's routed crossings follow
        # one another around the ring, one piece's NIC leg each.
        step_x = np.maximum(xs.max(axis=1), vias.sum(axis=1))
        tail = np.cumsum(summed(comp)[:, :, ::-1], axis=2)[:, :, ::-1]     # kernels of steps t >= s
        arrive = np.concatenate([np.zeros((G, 1)), np.cumsum(step_x[:, :k - 1], axis=1)], axis=1)
        # Position j ends at max over s of (arrival of step s + its kernels from s on).
        chain = (arrive[:, None, :] + tail).max(axis=2)                    # (G, pos)
        if backward and k > 1:
            chain = np.maximum(chain, np.roll(chain, 1, axis=1) + last[:, None])
        group = of[np.concatenate(leg_ring)] if leg_ring else np.zeros(0, np.int64)
        port = np.concatenate(leg_port) if leg_port else np.zeros(0, np.int64)
        held = np.concatenate(leg_sec) if leg_sec else np.zeros(0)
        np.add.at(load, port, held)

        def finish(total: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            end = np.maximum(chain, self._drain(group, port, total, G)[:, None])
            return tuples.ravel(), np.repeat(np.arange(G), k), end.ravel()

        return finish

    def _ulysses(self, groups: list, backward: bool, work: np.ndarray, load: np.ndarray, w: int):
        """Ulysses groups: all-to-all (always direct), kernel on ``1/d`` of the heads, all-to-all."""
        share = self.attn_share[backward]
        kernels, legs = [], []
        leg_group, leg_port, leg_sec, leg_a2a = [], [], [], []
        for gi, (ranks, L) in enumerate(groups):
            d = len(ranks)
            tokens = np.diff(np.arange(d + 1) * L // d).astype(np.float64)
            hq, hk = self.q_heads // d, self.kv_heads // d
            pairs = np.array([(L * (L + 1) // 2) // d], np.float64)
            c = float(self._attn_s(pairs, np.array([float(L)]))[0]) * share
            r = np.asarray(ranks, np.int64)
            work[r] += c
            kernels.append((r, c))
            a, bb = np.nonzero(~np.eye(d, dtype=bool))
            for step, to_heads in enumerate((True, False)):
                heads = hq if to_heads == backward else hq + 2 * hk
                rows = tokens[a] if to_heads else tokens[bb]
                _, _, msg, port, held = self._transfers(r[a], r[bb], rows * heads * self.head_dim * self.isz, w, False)
                leg_group.append(np.full(len(port), gi))
                leg_a2a.append(np.full(len(port), 2 * gi + step))
                leg_port.append(port)
                leg_sec.append(held)
        group, a2a = np.concatenate(leg_group), np.concatenate(leg_a2a)
        port, held = np.concatenate(leg_port), np.concatenate(leg_sec)
        np.add.at(load, port, held)
        # Each all-to-all lasts as long as its busiest port needs.
        key = a2a * len(load) + port
        uniq, inv = np.unique(key, return_inverse=True)
        busiest = np.zeros(2 * len(groups))
        np.maximum.at(busiest, uniq // len(load), np.bincount(inv, weights=held))

        in_s, out_s = busiest[0::2], busiest[1::2]
        # A rank's groups share its ports and lane: their all-to-alls arrive one
        # after another (in order), their kernels run in that order as the data
        # arrives, and the last one's outputs go after.
        arrived, lane, last = {}, {}, {}
        for gi, (ranks, _) in enumerate(groups):
            for r in ranks:
                arrived[r] = arrived.get(r, 0.0) + in_s[gi]
                lane[r] = max(lane.get(r, 0.0), arrived[r]) + kernels[gi][1]
                last[r] = gi

        def finish(total: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            drain = self._drain(group, port, total, len(groups))
            flat = np.concatenate([r for r, _ in kernels])
            gid = np.repeat(np.arange(len(kernels)), [len(r) for r, _ in kernels])
            end = np.array([max(lane[r] + out_s[last[r]], drain[g]) for r, g in zip(flat.tolist(), gid.tolist())])
            return flat, gid, end

        return finish

    # -------------------------------------------------------- switch, linear
    def _switch(self, messages: tuple[np.ndarray, np.ndarray, np.ndarray], w: int, routed: bool,
                reverse: bool) -> _Segment:
        src, dst, tokens = messages
        if reverse:
            src, dst = dst, src
        load = np.zeros(2 * w + 2 * (w // self.gpn + 1) * self.nics)
        _, _, _, port, held = self._transfers(src, dst, tokens * self.row_bytes, w, routed)
        np.add.at(load, port, held)
        g = self.gpn
        r = np.arange(w)
        nic = 2 * w + 2 * ((r // g) * self.nics + self.affinity[r % g])
        per_rank = np.maximum.reduce([load[2 * r], load[2 * r + 1], load[nic], load[nic + 1]])
        return _Segment(np.zeros(w), [], per_rank)

    def _linear(self, tokens: np.ndarray, backward: bool) -> _Segment:
        lin = np.array([self.cost.linear_s(t) for t in tokens.tolist()]) * self.lin_share[backward]
        return _Segment(lin, [])

    # ------------------------------------------------------------------ step
    def step_s(self, plan: Plan) -> float:
        """Modeled step of ``plan`` in seconds: the replay's ``step_s`` (sync tail included)."""
        w = plan.world_size
        routed = plan.routed and self.cost.routing
        grouped: dict[tuple[int, int], int] = {}
        for t in plan.remap_schedule():
            grouped[(t.src, t.dst)] = grouped.get((t.src, t.dst), 0) + t.length
        tokens = np.asarray(plan.linear_tokens_per_rank(), np.float64)
        parts = {}
        for bw in PASSES:
            seq = [("attn", self._attention(plan, bw, routed))]
            if grouped:
                msgs = tuple(np.asarray(x, np.int64) for x in zip(*((s, d, n) for (s, d), n in grouped.items())))
                seq.append(("to_linear", self._switch(msgs, w, routed, reverse=bw)))
            seq.append(("linear", self._linear(tokens, bw)))
            if grouped:
                seq.append(("to_attn", self._switch(msgs, w, routed, reverse=not bw)))
            parts[bw] = seq
        m = REPLAYED_LAYERS
        layers = self.layers

        def run(n: int) -> np.ndarray:
            t = np.zeros(w)
            chain = [s for _, s in parts[False]] * n + [s for _, s in reversed(parts[True])] * n
            for seg in chain:
                t = self._advance(seg, t)
            return t

        if layers <= m:
            finish = run(layers)
        else:
            big, small = run(m), run(m - 1)
            finish = big + (big - small) * (layers - m)
        slowest = int(np.argmax(finish))
        attn = sum(seg.work[slowest] for bw in PASSES for name, seg in parts[bw] if name == "attn") * layers
        lin = sum(seg.work[slowest] for bw in PASSES for name, seg in parts[bw] if name == "linear") * layers
        tail = step_sync(self.cost, *forward_backward_split(attn, lin))
        return float(finish.max()) + tail.exposed_s

    @staticmethod
    def _advance(seg: _Segment, entry: np.ndarray) -> np.ndarray:
        """Per rank, when it leaves ``seg`` having entered at ``entry``."""
        if seg.alltoall is not None:
            busy = seg.alltoall > 0
            if not busy.any():
                return entry
            start = float(entry[busy].max())
            return np.where(busy, start + seg.alltoall, entry)
        out = entry + seg.work
        for flat, gid, end in seg.chains:
            start = np.full(gid.max() + 1, -np.inf)
            np.maximum.at(start, gid, entry[flat])
            np.maximum.at(out, flat, start[gid] + end)
        return out


def surrogate_step_s(plan: Plan, cost: CostModel) -> float:
    """Convenience: :meth:`StepSurrogate.step_s` of one plan."""
    return StepSurrogate(cost).step_s(plan)
