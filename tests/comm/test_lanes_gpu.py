"""On CUDA, communication runs on a stream of its own (skipped without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_zeppelin.comm.direct import DirectCommunicator
from megatron_zeppelin.topology import Topology

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_communication_stream_is_not_the_compute_stream():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        comm = DirectCommunicator(None, Topology(nodes=1, gpus_per_node=1, nics_per_node=1))
        assert comm.stream is not None
        assert comm.stream != torch.cuda.current_stream()
        comm.close()
    finally:
        dist.destroy_process_group()
