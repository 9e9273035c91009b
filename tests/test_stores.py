"""The slow tiers: the disk store reads what the ram store holds, with O_DIRECT, from a file
converted once; a failed or short read is an error, never stale weights."""
import os

import pytest
import torch

from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.stores import DiskStore, RamStore, convert_to_disk
from expertcache.errors import FetchError
from expertcache.models import model_args


def test_disk_store_reads_what_ram_holds(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["qwen2_moe"][0])
    args = model_args(ckpt.config)
    ram = RamStore(ckpt, args)
    disk = DiskStore(convert_to_disk(ckpt, args, tmp_path), args)
    assert os.stat(tmp_path / "experts.bin").st_size % 4096 == 0
    if hasattr(os, "O_DIRECT"):
        import fcntl
        assert fcntl.fcntl(disk.fd, fcntl.F_GETFL) & os.O_DIRECT
    w13, w2 = torch.empty(ram.shape.w13), torch.empty(ram.shape.w2)
    for layer in range(args.num_layers):
        for e in range(args.num_experts):
            assert disk.read_into(layer, e, w13, w2) % 4096 == 0
            assert torch.equal(w13, ram.w13[layer, e]) and torch.equal(w2, ram.w2[layer, e])


def test_short_read_is_an_error(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["mixtral"][0])
    args = model_args(ckpt.config)
    disk = DiskStore(convert_to_disk(ckpt, args, tmp_path), args)
    os.truncate(tmp_path / "experts.bin", disk.blob * (args.num_experts + 1))  # lose most of layer 1
    w13, w2 = torch.empty(disk.shape.w13), torch.empty(disk.shape.w2)
    disk.read_into(0, 3, w13, w2)
    with pytest.raises(FetchError, match="short read"):
        disk.read_into(1, args.num_experts - 1, w13, w2)


def test_failed_read_is_an_error(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["mixtral"][0])
    args = model_args(ckpt.config)
    disk = DiskStore(convert_to_disk(ckpt, args, tmp_path), args)
    os.close(disk.fd)
    disk.fd = os.open(os.devnull, os.O_WRONLY)  # reads fail with EBADF
    with pytest.raises(FetchError, match="failed"):
        disk.read_into(0, 0, torch.empty(disk.shape.w13), torch.empty(disk.shape.w2))
