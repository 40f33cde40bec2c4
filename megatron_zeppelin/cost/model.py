"""Analytic cost model: seconds for attention, linear work, rings, all-to-alls, remaps.

Every time is for one whole training step of the model (all layers, forward
plus backward) unless a name says otherwise.  Constants come from the cluster
and model presets; the few algorithmic ratios below carry their source.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from megatron_zeppelin.cost.moe import ALLTOALLS_PER_LAYER, moe_alltoall_bytes, moe_alltoall_group
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.model_config import ModelConfig
from megatron_zeppelin.plan.shards import causal_pairs
from megatron_zeppelin.topology import ClusterConfig, LinkSpec

#: Attention backward FLOPs / forward FLOPs: FlashAttention-2's backward runs 5
#: GEMM-sized products against the forward's 2 (Dao 2023, Sec. 3.1).
ATTN_BWD_RATIO = 2.5
#: Linear backward FLOPs / forward FLOPs: grads w.r.t. input and weight (2x).
LINEAR_BWD_RATIO = 2.0
#: Ring backward bytes / forward bytes: K,V travel again and dK,dV travel back.
RING_BWD_BYTES_RATIO = 2.0
#: Layout switches per layer and step: attention -> linear and back, forward and backward.
REMAP_SWITCHES_PER_LAYER = 4
#: TP collectives per layer and step: forward all-gather + reduce-scatter
#: around attention and around the MLP (sequence parallelism), and the same
#: two pairs again in backward; each pair moves what one all-reduce moves
#: (Korthikanti et al. 2022, Sec. 4.2.2).  Megatron runs them on the compute
#: stream unless ``--tp-comm-overlap`` (off by default): not hidden.
TP_ALLREDUCES_PER_LAYER = 4
#: All-to-alls per layer and step of Ulysses: Q,K,V in and O out forward, the
#: same two backward (DeepSpeed-Ulysses, Jacobs et al. 2023, Sec. 3.1).
ULYSSES_ALLTOALLS_PER_LAYER = 4
#: Token counts ``CostModel.linear_s`` keeps (a few MB; a batch asks a few thousand).
LINEAR_MEMO_SIZE = 1 << 16


#: What the backward ring's dK/dV messages may travel in: ``model``, the K/V
#: dtype, as TransformerEngine's p2p CP ring sends them (each rank accumulates
#: in fp32, rounds once per send, adds what arrives into fp32); ``fp32``, exact
#: accumulation along the ring at twice a bf16 model's backward ring bytes.
RING_GRAD_DTYPES = ("model", "fp32")
#: The default: what Megatron-LM / TransformerEngine CP users run today.
DEFAULT_RING_GRAD_DTYPE = "model"


def check_ring_grad_dtype(setting: str) -> str:
    """``setting`` if it names a ring-gradient dtype, else a ConfigError naming the choices."""
    if setting not in RING_GRAD_DTYPES:
        raise ConfigError(f"ring gradient dtype {setting!r} is not one of {', '.join(RING_GRAD_DTYPES)} "
                          "(model: dK/dV travel in the K/V dtype, as TransformerEngine sends them; "
                          "fp32: exact accumulation)")
    return setting


def ring_grad_itemsize(setting: str, itemsize: int) -> int:
    """Bytes per element of the backward ring's dK/dV messages of a model whose
    K/V have ``itemsize`` bytes (fp32 and fp64 models: the same under both)."""
    return itemsize if check_ring_grad_dtype(setting) == "model" else max(itemsize, 4)


_ARRAY = np.ndarray     # what attn_s answers elementwise (a class check: attn_s is on the replay's hot path)


@dataclass(frozen=True)
class RingCost:
    """Per-rank cost of one ring attention (all layers, forward + backward)."""

    compute_s: float
    """Attention kernel time on each rank."""
    transfer_s: float
    """Time the link needs for all K/V (and dK/dV) blocks, ignoring overlap."""
    total_s: float
    """Critical path with each step's transfer overlapped with its compute."""

    @property
    def exposed_s(self) -> float:
        """Communication the compute could not hide."""
        return self.total_s - self.compute_s


@dataclass(frozen=True)
class CostModel:
    """Seconds of work on one cluster for one model."""

    cluster: ClusterConfig
    model: ModelConfig
    routing: bool = True
    """Inter-node transfers spread over all NICs of the node through proxies."""
    ring_grad_dtype: str = DEFAULT_RING_GRAD_DTYPE
    """What the engine's backward ring sends dK/dV in (:data:`RING_GRAD_DTYPES`);
    the replay, the surrogate and the engine read it through :attr:`ring_grad_bytes`."""
    tp_size: int = 1
    """GPUs per rank: each rank is a tensor-parallel group of this many GPUs
    (build with :func:`megatron_zeppelin.cost.tp.tp_view`, which also widens the
    cluster); ``linear_s`` then pays the TP collectives."""
    linear_memo: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """``linear_s`` of the integer token counts asked so far (at most
    :data:`LINEAR_MEMO_SIZE`, then it starts over): planners and their
    per-batch decision ask it thousands of times a batch, mostly for counts
    they asked before (a copy made by ``replace`` starts empty)."""

    def __post_init__(self) -> None:
        check_ring_grad_dtype(self.ring_grad_dtype)

    @property
    def ring_grad_bytes(self) -> int:
        """Bytes per element of the engine's backward ring dK/dV messages."""
        return ring_grad_itemsize(self.ring_grad_dtype, self.model.dtype_bytes)

    # ------------------------------------------------------------- compute
    def attn_efficiency(self, block: float) -> float:
        """Fraction of peak reached by attention on query blocks of ``block``
        tokens: ``eff * block / (block + half_block)``, falling for short blocks."""
        g = self.cluster.gpu
        return g.attn_efficiency * block / (block + g.attn_half_block)

    def attn_s(self, pairs: float | np.ndarray, block: float | np.ndarray) -> float | np.ndarray:
        """Forward+backward attention time of ``pairs`` causal query-key pairs
        computed in query blocks of ``block`` tokens.  Either may be a numpy
        array: elementwise, the same float operations in the same order, so
        every element equals the scalar answer bit for bit."""
        vector = pairs.__class__ is _ARRAY or block.__class__ is _ARRAY
        if vector:
            live = np.asarray(pairs) > 0
            block = np.where(live, block, 1)    # no pairs, no time: nor a division by an empty block
        elif pairs <= 0:
            return 0.0
        flops = pairs * self.model.attn_flops_per_pair * (1 + ATTN_BWD_RATIO)
        seconds = flops / (self.cluster.gpu.peak_tflops * 1e12 * self.attn_efficiency(block))
        return np.where(live, seconds, 0.0) if vector else seconds

    def local_attn_s(self, length: int) -> float:
        """Attention of one whole causal sequence on one GPU."""
        return self.attn_s(causal_pairs(0, length), length)

    def linear_s(self, tokens: float) -> float:
        """Forward+backward time of projections, MLP (MoE: with the router's all-to-all)
        and output layer for ``tokens``."""
        if type(tokens) is int:
            memo = self.linear_memo
            known = memo.get(tokens)
            if known is None:
                if len(memo) >= LINEAR_MEMO_SIZE:
                    memo.clear()
                known = memo[tokens] = self._linear_s(tokens)
            return known
        return self._linear_s(tokens)

    def _linear_s(self, tokens: float) -> float:
        g = self.cluster.gpu
        flops = tokens * self.model.linear_flops_per_token * (1 + LINEAR_BWD_RATIO)
        return (flops / (g.peak_tflops * 1e12 * g.linear_efficiency) + self.tp_comm_s(tokens)
                + self.moe_dispatch_s(tokens))

    def moe_dispatch_s(self, tokens: float) -> float:
        """Seconds of the router's all-to-alls for ``tokens`` tokens of one rank
        (``cost/moe.py``; 0 for a dense model or experts on every rank)."""
        m = self.model
        group = moe_alltoall_group(m, self.cluster.topology.world_size)
        if group is None:
            return 0.0
        link = self.alltoall_link(group)
        return ALLTOALLS_PER_LAYER * m.num_layers * self.alltoall_s(moe_alltoall_bytes(m, tokens),
                                                                    m.expert_parallel_size, link)

    def tp_comm_s(self, tokens: float) -> float:
        """The TP collectives of ``tokens`` over all layers (0 without TP): per
        layer ``TP_ALLREDUCES_PER_LAYER`` ring all-reduces of the hidden states,
        each GPU moving ``2 (t-1)/t`` of them over its own NVLink."""
        t = self.tp_size
        if t == 1 or tokens <= 0:
            return 0.0
        nvl = self.cluster.nvlink
        per_gpu_bw = nvl.bandwidth_GBps / t * 1e9   # the TP view widened NVLink t-fold
        one = (2 * (t - 1) / t * tokens * self.model.hidden_bytes_per_token / per_gpu_bw
               + 2 * (t - 1) * nvl.latency_us * 1e-6)
        return TP_ALLREDUCES_PER_LAYER * self.model.num_layers * one

    # ---------------------------------------------------------------- links
    def link_for(self, ranks: Sequence[int]) -> LinkSpec:
        """The slowest link a ring or group over ``ranks`` uses per step.

        Inside a node that is NVLink.  Across nodes each ring step crosses every
        node boundary once; without routing that crossing goes through the one
        NIC of the sending GPU, with routing it is split over all NICs of the
        node (:meth:`routed_link`)."""
        topo, nic, nvl = self.cluster.topology, self.cluster.nic, self.cluster.nvlink
        if len({topo.node_of(r) for r in ranks}) == 1:
            return nvl
        if not self.routing or topo.nics_per_node == 1:
            return nic
        return self.routed_link()

    def direct_link(self, sharing: int = 1) -> LinkSpec:
        """One GPU's NIC when ``sharing`` concurrent messages use it."""
        nic = self.cluster.nic
        return LinkSpec(bandwidth_GBps=nic.bandwidth_GBps / max(sharing, 1), latency_us=nic.latency_us)

    def routed_link(self, sharing: int = 1) -> LinkSpec:
        """A message routed over the ``P`` NICs of its node while ``sharing``
        routed messages leave the node at once.

        The routing layer cuts a message in ``P`` pieces and forwards each in
        three store-and-forward hops (comm/routing.py): the sender dispatches
        ``(P-1)/P`` of the bytes over its NVLink, each NIC carries ``1/P`` (times
        the messages sharing it), the receiver's NVLink takes ``(P-1)/P`` back in.
        A piece's hops follow one another, so the stages add up: seconds per byte
        ``2 (P-1)/(P nvl) + sharing/(P nic)``; latency NIC + 2 NVLink hops."""
        P, nic, nvl = self.cluster.topology.nics_per_node, self.cluster.nic, self.cluster.nvlink
        per_byte = (2 * (P - 1) / (P * nvl.bandwidth_GBps)
                    + max(sharing, 1) / (P * nic.bandwidth_GBps))
        return LinkSpec(bandwidth_GBps=1 / per_byte, latency_us=nic.latency_us + 2 * nvl.latency_us)

    def crossing_link(self, nbytes: float, direct_sharing: int = 1, routed_sharing: int = 1) -> LinkSpec:
        """The link a cross-node message of ``nbytes`` takes: routed when routing
        is on and it is faster for that size (the break-even the routing layer
        applies, :func:`~megatron_zeppelin.comm.routing.min_routed_bytes`), else
        its sender's NIC."""
        direct = self.direct_link(direct_sharing)
        if not self.routing or self.cluster.topology.nics_per_node == 1:
            return direct
        routed = self.routed_link(routed_sharing)
        return routed if routed.transfer_s(nbytes) < direct.transfer_s(nbytes) else direct

    def alltoall_link(self, ranks: Sequence[int]) -> LinkSpec:
        """The per-GPU link of an all-to-all (Ulysses) over ``ranks``.

        Inside a node that is NVLink.  Across nodes every GPU sends its share
        through the node's NICs at the same time, so each gets ``NICs / GPUs``
        of a NIC: unlike a ring's node boundary, there is no idle NIC for
        routing to borrow."""
        topo, nic, nvl = self.cluster.topology, self.cluster.nic, self.cluster.nvlink
        if len({topo.node_of(r) for r in ranks}) == 1:
            return nvl
        share = nic.bandwidth_GBps * topo.nics_per_node / topo.gpus_per_node
        return LinkSpec(bandwidth_GBps=min(share, nvl.bandwidth_GBps), latency_us=nic.latency_us)

    def routed(self, routing: bool) -> "CostModel":
        return replace(self, routing=routing)

    # ---------------------------------------------------------------- rings
    def ring_cost(self, lengths: Sequence[int], ring_size: int, link: LinkSpec) -> RingCost:
        """One zigzag ring over ``ring_size`` ranks computing the sequences in
        ``lengths`` together (TE's packed THD ring sends all of them each step;
        Zeppelin's rings hold one sequence).

        Each rank holds 2 chunks of ``L / 2k`` tokens per sequence; every one of
        the ``k`` steps computes ~``L^2 / 2k^2`` pairs per rank and sends the
        rank's K/V (``L / k`` tokens) to the next rank.  Step ``j+1``'s compute
        waits for step ``j``'s transfer, so a step costs max(compute, transfer)."""
        k = ring_size
        m = self.model
        n = m.num_layers
        # attn_s covers fwd+bwd of all layers; the overlap happens per layer and pass.
        step_fwd = sum(self.attn_s(L * L / (2 * k * k), L / (2 * k)) for L in lengths)
        step_fwd /= (1 + ATTN_BWD_RATIO) * n
        step_bwd = step_fwd * ATTN_BWD_RATIO
        step_tokens = sum(L / k for L in lengths)
        fwd_bytes = step_tokens * m.kv_bytes_per_token
        x_fwd = link.transfer_s(fwd_bytes)
        x_bwd = link.transfer_s(fwd_bytes * RING_BWD_BYTES_RATIO)
        compute = k * (step_fwd + step_bwd)
        if k == 1:
            return RingCost(compute * n, 0.0, compute * n)
        transfer = (k - 1) * (x_fwd + x_bwd)
        total = step_fwd + step_bwd + (k - 1) * (max(step_fwd, x_fwd) + max(step_bwd, x_bwd))
        return RingCost(compute * n, transfer * n, total * n)

    def ring_bytes(self, length: int, ring_size: int) -> float:
        """Bytes all ranks of a ring over one sequence send in a step: ``k - 1``
        steps in which together they pass the K/V of ``L`` tokens, forward plus
        ``RING_BWD_BYTES_RATIO`` times that backward, in every layer."""
        m = self.model
        return ((ring_size - 1) * length * m.kv_bytes_per_token * m.num_layers
                * (1 + RING_BWD_BYTES_RATIO))

    # ------------------------------------------------------------- ulysses
    def ulysses_bytes_per_rank(self, length: int, group_size: int) -> float:
        """Bytes one rank of a Ulysses group puts in each all-to-all's input: its
        ``L/d`` tokens' Q, K, V and output."""
        m = self.model
        return (length / group_size) * (2 * m.hidden_size + 2 * m.kv_size) * m.dtype_bytes

    def ulysses_bytes(self, length: int, group_size: int) -> float:
        """Bytes all ranks of a Ulysses group send in a step: each sends ``(d-1)/d``
        of its all-to-all input, forward and backward, in every layer."""
        d = group_size
        return 2 * self.model.num_layers * d * self.ulysses_bytes_per_rank(length, d) * (d - 1) / d

    def alltoall_s(self, bytes_per_rank: float, group_size: int, link: LinkSpec) -> float:
        """One all-to-all where each rank sends ``(d-1)/d`` of ``bytes_per_rank``
        (one message to each of the ``d - 1`` others)."""
        if group_size <= 1:
            return 0.0
        sent = bytes_per_rank * (group_size - 1) / group_size
        return link.latency_us * 1e-6 * (group_size - 1) + sent / (link.bandwidth_GBps * 1e9)

    def ulysses_cost(self, lengths: Sequence[int], group_size: int, link: LinkSpec, *,
                     latency: bool = True) -> RingCost:
        """Ulysses sequence parallelism of the sequences in ``lengths`` packed on
        one group of ``d`` ranks, as DeepSpeed-Ulysses and FlexSP run them: per
        layer one all-to-all carries Q, K, V of *all* the group's sequences
        (tokens -> heads) and one carries the outputs back, the backward the same
        again; attention runs on ``heads / d`` over each full sequence.  Nothing
        overlaps (the all-to-alls sit on the critical path).  ``latency=False``
        leaves out the per-collective latency (a per-sequence share of a packed
        group, as FlexSP's additive time model needs)."""
        m, d = self.model, group_size
        compute = sum(self.attn_s(causal_pairs(0, L) / d, L) for L in lengths)
        if d <= 1:
            return RingCost(compute, 0.0, compute)
        sent = sum(self.ulysses_bytes_per_rank(L, d) for L in lengths) * (d - 1) / d
        comm = self._ulysses_comm_s(sent, link)
        if latency:
            comm += ULYSSES_ALLTOALLS_PER_LAYER * m.num_layers * (d - 1) * link.latency_us * 1e-6
        return RingCost(compute, comm, compute + comm)

    def ulysses_alone_s(self, lengths: np.ndarray, group_size: int, link: LinkSpec) -> np.ndarray:
        """``ulysses_cost([L], group_size, link, latency=False).total_s`` of every
        ``L`` in ``lengths`` at once (each sequence alone on the group; FlexSP's
        per-sequence time), equal to it bit for bit: the same functions of the
        terms (``attn_s``, ``ulysses_bytes_per_rank``), given arrays."""
        d, lens = group_size, np.asarray(lengths, dtype=np.int64)
        compute = self.attn_s(causal_pairs(0, lens) / d, lens)
        if d <= 1:
            return compute
        return compute + self._ulysses_comm_s(self.ulysses_bytes_per_rank(lens, d) * (d - 1) / d, link)

    def _ulysses_comm_s(self, sent: float | np.ndarray, link: LinkSpec) -> float | np.ndarray:
        """The all-to-alls' transfer time of ``sent`` bytes per rank and direction,
        forward and backward in every layer, latency left out."""
        return 2 * self.model.num_layers * sent / (link.bandwidth_GBps * 1e9)

    # ---------------------------------------------------------------- remap
    def remap_s(self, intra_bytes: float, inter_bytes: float, messages: int = 1) -> float:
        """A rank's share of one layout switch, repeated four times per layer
        (attention->linear and back, forward and backward).  Bytes are what the
        busiest rank sends per layer per direction over NVLink and NICs."""
        c = self.cluster
        topo = c.topology
        nvl_bytes, nic_bw = intra_bytes, c.nic.bandwidth_GBps
        if self.routing and topo.nics_per_node > 1:
            # Routed, the busiest node's bytes leave through all its NICs, and its
            # GPUs dispatch and combine (P-1)/P of them over the NVLinks that
            # carry the intra-node part of the switch: the legs compete.
            P = topo.nics_per_node
            nic_bw *= P
            nvl_bytes += 2 * (P - 1) / P * inter_bytes / topo.gpus_per_node
        one = max(nvl_bytes / (c.nvlink.bandwidth_GBps * 1e9), inter_bytes / (nic_bw * 1e9))
        one += messages * c.nvlink.latency_us * 1e-6 if intra_bytes or inter_bytes else 0.0
        return REMAP_SWITCHES_PER_LAYER * self.model.num_layers * one

    # ------------------------------------------------------------ estimates
    def lower_bound_s(self, seq_lens: Sequence[int]) -> float:
        """Step time if all work were split perfectly over every GPU with no
        communication and each sequence's attention ran at its full-length
        kernel efficiency."""
        tokens = sum(seq_lens)
        work = (sum(self.local_attn_s(L) for L in seq_lens) + self.linear_s(tokens)
                - self.tp_comm_s(tokens))    # the same on a TP view of the cluster
        return work / self.cluster.topology.world_size
