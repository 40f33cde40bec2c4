"""GPU -> NIC affinity: parse ``nvidia-smi topo -m``, detect it, check it against a preset.

The routing layer sends piece ``j`` of a cross-node message through the GPUs
bound to NIC ``j``.  The binding comes from the cluster preset
(``nic_affinity``); on a GPU node it can be read from the PCIe topology and
checked, because a wrong map silently funnels traffic through a far NIC (a
``SYS`` path crosses the CPU interconnect and runs at a fraction of the NIC's
rate).

NIC indices are *dense and node-local*: the NICs that are the closest NIC of
at least one GPU, numbered in the order ``nvidia-smi`` lists them.  NICs no GPU
is closest to (storage or management ports) are ignored.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.topology import Topology

#: PCIe distance classes of ``nvidia-smi topo -m``, closest first (its legend):
#: PIX one PCIe bridge, PXB several bridges, PHB through a host bridge, NODE
#: between host bridges of one NUMA node, SYS across the SMP interconnect.
LINK_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}

_GPU = re.compile(r"^GPU(\d+)$")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")


@dataclass(frozen=True)
class TopoMatrix:
    """The GPU x NIC part of a ``nvidia-smi topo -m`` matrix."""

    gpus: tuple[int, ...]
    """GPU indices, in row order."""
    nics: tuple[str, ...]
    """NIC device names (``mlx5_0``), in column order."""
    links: tuple[tuple[str, ...], ...]
    """``links[i][k]``: distance class between ``gpus[i]`` and ``nics[k]``."""


def _is_link(cell: str) -> bool:
    return cell == "X" or cell in LINK_RANK or bool(re.match(r"^NV\d+$", cell))


def parse_topo_matrix(text: str) -> TopoMatrix:
    """The GPU rows and NIC columns of ``nvidia-smi topo -m`` output (both the
    ``NIC0 .. + NIC Legend`` format of drivers >= 470 and the older format
    whose columns are device names such as ``mlx5_0``)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # The header's first cells are column names ("GPU0 GPU1 .."); a GPU row's
    # second cell is its own diagonal entry or a link class ("X", "NV8").
    header_at = next((i for i, ln in enumerate(lines) if len(ln.split()) > 1
                      and _GPU.match(ln.split()[0]) and not _is_link(ln.split()[1])), None)
    if header_at is None:
        raise ConfigError("cannot parse `nvidia-smi topo -m` output: no header row of GPU columns "
                          "found; pass the full output of `nvidia-smi topo -m`")
    columns: list[str] = []
    for token in lines[header_at].split():
        if token == "CPU":  # "CPU Affinity", "NUMA Affinity", ... follow the device columns
            break
        columns.append(token)
    legend = dict(m.groups() for m in map(_NIC_LEGEND.match, lines) if m)
    nic_cols = [k for k, c in enumerate(columns) if not _GPU.match(c)]
    if not nic_cols:
        raise ConfigError("`nvidia-smi topo -m` lists no NIC columns; this node has no NIC the "
                          "routing layer could use (set nics_per_node to match the hardware)")
    gpus, links = [], []
    for ln in lines[header_at + 1:]:
        cells = ln.split()
        m = _GPU.match(cells[0])
        if not m:
            continue
        if len(cells) < 1 + len(columns):
            raise ConfigError(f"cannot parse `nvidia-smi topo -m` row {cells[0]}: {len(cells) - 1} "
                              f"entries for {len(columns)} columns")
        row = tuple(cells[1 + k] for k in nic_cols)
        bad = [c for c in row if c not in LINK_RANK]
        if bad:
            raise ConfigError(f"`nvidia-smi topo -m` row {cells[0]}: unknown GPU-NIC link {bad[0]!r} "
                              f"(expected one of {', '.join(LINK_RANK)})")
        gpus.append(int(m.group(1)))
        links.append(row)
    if not gpus:
        raise ConfigError("cannot parse `nvidia-smi topo -m` output: no GPU rows found")
    nics = tuple(legend.get(columns[k], columns[k]) for k in nic_cols)
    return TopoMatrix(tuple(gpus), nics, tuple(links))


def closest_nics(matrix: TopoMatrix) -> dict[int, int]:
    """GPU index -> dense NIC index of its closest NIC.

    Ties (a PCIe switch holding two GPUs and two NICs, as on DGX A100) go to the
    tied NIC fewest GPUs took so far, then to the first listed, so that GPU pairs
    spread over their NIC pair instead of piling on one."""
    load = [0] * len(matrix.nics)
    chosen: dict[int, int] = {}
    for gpu, row in sorted(zip(matrix.gpus, matrix.links)):
        best = min(LINK_RANK[c] for c in row)
        tied = [k for k, c in enumerate(row) if LINK_RANK[c] == best]
        k = min(tied, key=lambda k: (load[k], k))
        load[k] += 1
        chosen[gpu] = k
    dense = {col: i for i, col in enumerate(sorted(set(chosen.values())))}
    return {gpu: dense[col] for gpu, col in chosen.items()}


def parse_nvidia_smi_topo(text: str) -> dict[int, int]:
    """GPU index -> NIC index (dense, node-local) from ``nvidia-smi topo -m``."""
    return closest_nics(parse_topo_matrix(text))


def detect_nic_affinity() -> dict[int, int] | None:
    """This node's GPU -> NIC map, or None where no GPU (or no NIC) is visible.

    Tries ``nvidia-smi topo -m`` first, then the PCIe tree in sysfs.  GPU indices
    follow PCI bus order (``nvidia-smi`` numbering; set
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA agrees)."""
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return parse_nvidia_smi_topo(out.stdout)
        except (OSError, subprocess.TimeoutExpired, ConfigError):
            pass  # a driver without topo support: sysfs below still knows the PCIe tree
    return _detect_from_sysfs(Path("/sys"))


def _detect_from_sysfs(sys_root: Path) -> dict[int, int] | None:
    """Closest NIC by the deepest common PCIe ancestor of the device paths."""
    devices = sys_root / "bus" / "pci" / "devices"
    if not devices.is_dir():
        return None
    gpus = []
    for dev in sorted(devices.iterdir()):
        try:
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
        except OSError:
            continue
        # NVIDIA (0x10de) display (0x03xxxx) controllers; 0x0302 is "3D controller" (SXM parts).
        if vendor == "0x10de" and klass.startswith("0x03"):
            gpus.append(Path(os.path.realpath(dev)).parts)
    ib = sys_root / "class" / "infiniband"
    nics = sorted(Path(os.path.realpath(d / "device")).parts for d in ib.iterdir()) if ib.is_dir() else []
    if not gpus or not nics:
        return None
    links = []
    for g in gpus:
        depth = [len(os.path.commonprefix([g, n])) for n in nics]
        deepest = max(depth)
        # Same deepest ancestor depth = same PCIe switch (PIX/PXB); shallower ones are farther.
        links.append(tuple("PXB" if d == deepest else "SYS" for d in depth))
    return closest_nics(TopoMatrix(tuple(range(len(gpus))), tuple(map(str, range(len(nics)))),
                                   tuple(links)))


def affinity_tuple(mapping: Mapping[int, int], gpus_per_node: int, nics_per_node: int) -> tuple[int, ...]:
    """``Topology.nic_affinity`` from a GPU -> NIC map, naming a missing or unknown GPU or NIC."""
    extra = sorted(g for g in mapping if not 0 <= g < gpus_per_node)
    if extra:
        raise ConfigError(f"affinity map names GPU {extra[0]} but a node has GPUs 0..{gpus_per_node - 1}; "
                          "fix the map or gpus_per_node")
    missing = [g for g in range(gpus_per_node) if g not in mapping]
    if missing:
        raise ConfigError(f"affinity map has no NIC for GPU {missing[0]}; give every GPU 0.."
                          f"{gpus_per_node - 1} a NIC")
    bad = sorted(n for n in mapping.values() if not 0 <= n < nics_per_node)
    if bad:
        raise ConfigError(f"affinity map names NIC {bad[0]} but a node has NICs 0..{nics_per_node - 1}; "
                          "fix the map or nics_per_node")
    return tuple(mapping[g] for g in range(gpus_per_node))


def _canonical(affinity: tuple[int, ...]) -> tuple[int, ...]:
    """Relabel NICs by first appearance in GPU order: only the grouping of GPUs
    onto shared NICs is physical, the labels are the preset's choice."""
    labels: dict[int, int] = {}
    return tuple(labels.setdefault(n, len(labels)) for n in affinity)


def check_affinity(topology: Topology, detected: Mapping[int, int] | None) -> None:
    """Raise :class:`ConfigError` when the detected GPU -> NIC binding disagrees
    with the cluster description (nothing to check when ``detected`` is None)."""
    if detected is None:
        return
    gpn = topology.gpus_per_node
    if len(detected) != gpn:
        raise ConfigError(f"this node has {len(detected)} GPUs with a NIC, the cluster description "
                          f"says gpus_per_node={gpn}; fix the cluster preset")
    nics = len(set(detected.values()))
    if nics != topology.nics_per_node:
        raise ConfigError(f"the PCIe topology shows {nics} NICs serving GPUs, the cluster description "
                          f"says nics_per_node={topology.nics_per_node}; fix the cluster preset")
    found = affinity_tuple(detected, gpn, nics)
    want, got = _canonical(topology.nic_affinity), _canonical(found)
    if want != got:
        g = next(i for i in range(gpn) if want[i] != got[i])
        share_want = [i for i in range(gpn) if want[i] == want[g] and i != g]
        share_got = [i for i in range(gpn) if got[i] == got[g] and i != g]
        raise ConfigError(f"NIC affinity mismatch at GPU {g}: the cluster description puts it on NIC "
                          f"{topology.nic_affinity[g]} with GPUs {share_want}, the PCIe topology on a NIC "
                          f"shared with GPUs {share_got}; set nic_affinity: {list(found)} in the cluster "
                          "preset")
