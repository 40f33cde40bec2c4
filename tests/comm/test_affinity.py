"""NIC affinity: the `nvidia-smi topo -m` parser on recorded 4-NIC and 8-NIC
layouts, the sysfs fallback on a fake PCIe tree, and the preset check."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_zeppelin.comm.affinity import (_detect_from_sysfs, affinity_tuple, check_affinity,
                                             parse_nvidia_smi_topo, parse_topo_matrix)
from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.topology import Topology, load_cluster

DATA = Path(__file__).parent / "data"
A800 = (DATA / "nvidia-smi-topo-a800-4nic.txt").read_text()
H100 = (DATA / "nvidia-smi-topo-h100-8nic.txt").read_text()


def test_a800_four_nics_shared_by_gpu_pairs():
    m = parse_topo_matrix(A800)
    assert m.gpus == tuple(range(8)) and m.nics == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    assert m.links[5] == ("SYS", "SYS", "PXB", "NODE")
    assert parse_nvidia_smi_topo(A800) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    check_affinity(load_cluster("a800-4x200g").topology, parse_nvidia_smi_topo(A800))


def test_h100_one_nic_per_gpu_and_storage_nics_ignored():
    m = parse_topo_matrix(H100)
    assert len(m.nics) == 10 and m.nics[0] == "mlx5_0"  # names come from the NIC legend
    assert parse_nvidia_smi_topo(H100) == {g: g for g in range(8)}
    check_affinity(load_cluster("h100-8x400g").topology, parse_nvidia_smi_topo(H100))


def test_ties_spread_gpu_pairs_over_their_nic_pair():
    # DGX A100 style: GPU0 and GPU1 share a switch holding two NICs (both PXB).
    text = ("\tGPU0\tGPU1\tmlx5_0\tmlx5_1\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tNV12\tPXB\tPXB\t48-63\t3\n"
            "GPU1\tNV12\t X \tPXB\tPXB\t48-63\t3\n")
    assert parse_nvidia_smi_topo(text) == {0: 0, 1: 1}


def test_a_header_without_leading_tab_parses_the_same():
    stripped = "\n".join(line.lstrip("\t") for line in A800.splitlines())
    assert parse_nvidia_smi_topo(stripped) == parse_nvidia_smi_topo(A800)


@pytest.mark.parametrize("text, match", [
    ("no matrix here", "no header row"),
    ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV8\t0-3\n", "no NIC columns"),
    ("\tGPU0\tNIC0\tCPU Affinity\nGPU0\t X \tFAR\t0-3\n", "unknown GPU-NIC link 'FAR'"),
    ("\tGPU0\tNIC0\tNIC1\tCPU Affinity\nGPU0\t X \tPIX\n", "2 entries for 3 columns"),
])
def test_malformed_output_is_a_config_error(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_nvidia_smi_topo(text)


def test_check_names_the_mismatch_and_the_fix():
    topo = load_cluster("a800-4x200g").topology
    check_affinity(topo, None)  # nothing detected (CPU machine): nothing to check
    # NIC labels are the preset's choice; only the grouping is physical.
    check_affinity(topo, {g: 3 - g // 2 for g in range(8)})
    detected = {0: 0, 1: 1, 2: 0, 3: 1, 4: 2, 5: 3, 6: 2, 7: 3}  # pairs (0,2),(1,3) share NICs
    with pytest.raises(ConfigError, match=r"mismatch at GPU 1.*GPUs \[0\].*GPUs \[3\].*"
                                          r"nic_affinity: \[0, 1, 0, 1, 2, 3, 2, 3\]"):
        check_affinity(topo, detected)
    with pytest.raises(ConfigError, match="shows 8 NICs serving GPUs.*nics_per_node=4"):
        check_affinity(topo, parse_nvidia_smi_topo(H100))
    with pytest.raises(ConfigError, match="has 2 GPUs with a NIC.*gpus_per_node=8"):
        check_affinity(topo, {0: 0, 1: 1})


def test_affinity_map_naming_a_missing_gpu_or_nic():
    with pytest.raises(ConfigError, match="names GPU 4 but a node has GPUs 0..3"):
        affinity_tuple({0: 0, 1: 0, 2: 1, 3: 1, 4: 1}, 4, 2)
    with pytest.raises(ConfigError, match="no NIC for GPU 2"):
        affinity_tuple({0: 0, 1: 0, 3: 1}, 4, 2)
    with pytest.raises(ConfigError, match="names NIC 2 but a node has NICs 0..1"):
        affinity_tuple({0: 0, 1: 0, 2: 1, 3: 2}, 4, 2)
    assert affinity_tuple({0: 0, 1: 0, 2: 1, 3: 1}, 4, 2) == (0, 0, 1, 1)
    with pytest.raises(ConfigError, match="do not divide"):
        Topology(nodes=1, gpus_per_node=8, nics_per_node=3)


def _fake_sysfs(root: Path) -> None:
    """Two PCIe switches under one root port, a GPU and a NIC behind each switch."""
    pci = root / "devices" / "pci0000:00" / "0000:00:01.0"
    devices = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    ib = root / "class" / "infiniband"
    ib.mkdir(parents=True)
    for switch, (gpu, nic) in enumerate([("0000:1b:00.0", "0000:1c:00.0"), ("0000:3b:00.0", "0000:3c:00.0")]):
        port = pci / f"0000:0{switch + 1}:00.0"
        for bdf, vendor, klass in ((gpu, "0x10de", "0x030200"), (nic, "0x15b3", "0x020700")):
            dev = port / bdf
            dev.mkdir(parents=True)
            (dev / "vendor").write_text(vendor + "\n")
            (dev / "class").write_text(klass + "\n")
            (devices / bdf).symlink_to(dev)
        (ib / f"mlx5_{1 - switch}").mkdir()
        (ib / f"mlx5_{1 - switch}" / "device").symlink_to(port / nic)


def test_sysfs_fallback_finds_the_nic_behind_each_switch(tmp_path):
    assert _detect_from_sysfs(tmp_path) is None  # no PCI tree: a CPU machine
    _fake_sysfs(tmp_path)
    assert _detect_from_sysfs(tmp_path) == {0: 0, 1: 1}
