"""The slow tiers: the disk store reads what the ram store holds, with O_DIRECT, from a file
converted once; a failed or short read is an error, never stale weights."""
import json
import os

import pytest
import torch

from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.quant import FLOAT_DTYPES, ExpertFormat, encoded_bytes, error_bound, roundtrip
from expertcache.engine.stores import DiskStore, RamStore, convert_to_disk, open_store
from expertcache.errors import CheckpointError, FetchError
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


@pytest.mark.parametrize("dtype,group,scheme", [("float16", 0, ""), ("bfloat16", 0, ""), ("int8", 16, "asym"),
                                                ("int4", 16, "asym"), ("int4", 32, "sym"), ("int8", 12, "sym")])
def test_quantized_store_round_trip(tiny, tmp_path, dtype, group, scheme):
    """Each format's disk store serves every expert within the format's error bound of the original
    weights, in the original shapes, from 4 KiB-aligned blobs, and exactly what its ram emulation holds."""
    ckpt = open_checkpoint(tiny["gpt_oss"][0])  # expert biases: four parts per blob
    args = model_args(ckpt.config)
    fmt = ExpertFormat.parse(dtype, group, scheme or "asym")
    disk = DiskStore(convert_to_disk(ckpt, args, tmp_path, fmt=fmt), args)
    meta = json.loads((tmp_path / "experts.json").read_text())
    assert ExpertFormat.from_meta(meta) == fmt and meta["blob_bytes"] % 4096 == 0
    assert os.stat(tmp_path / "experts.bin").st_size == meta["blob_bytes"] * args.num_layers * args.num_experts
    if fmt.quantized:
        assert encoded_bytes(disk.shape.parts, fmt) < encoded_bytes(disk.shape.parts, ExpertFormat())
    exact = RamStore(ckpt, args)
    emulated = RamStore(ckpt, args, fmt=fmt) if fmt.quantized else None
    slot = [torch.full(p, float("nan")) for p in disk.shape.parts]
    for layer in range(args.num_layers):
        for e in range(args.num_experts):
            assert disk.read_into(layer, e, *slot) == meta["blob_bytes"]
            for got, want in zip(slot, exact._sources(layer, e)):
                assert got.shape == want.shape and got.isfinite().all()
                assert ((got - want).abs() <= error_bound(want, fmt)).all()
            if emulated is not None:
                for got, want in zip(slot, emulated._sources(layer, e)):
                    assert torch.equal(got, want)
    # the float formats keep their dtype's values exactly
    if not fmt.quantized:
        want = exact.w13[0, 1].to(FLOAT_DTYPES[dtype]).float()
        disk.read_into(0, 1, *slot)
        assert torch.equal(slot[0], want)


def test_int4_error_is_within_a_half_step_and_not_zero():
    """The bound is tight enough to fail: int4 moves weights, by no more than half a group's step."""
    w = torch.randn(24, 100)
    fmt = ExpertFormat.parse("int4", 32)
    err = (roundtrip(w, fmt) - w).abs()
    assert err.max() > 0.01 and (err <= error_bound(w, fmt)).all()
    assert (err > error_bound(w, ExpertFormat.parse("int8", 32))).any()


@pytest.mark.parametrize("change", [{"dtype": "int3"}, {"group_size": 0}, {"group_size": "64"},
                                    {"scheme": "nf4"}, {"blob_bytes": 8192}, {"dtype": "float16"}])
def test_corrupted_format_header_is_refused(tiny, tmp_path, change):
    ckpt = open_checkpoint(tiny["qwen2_moe"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path, fmt=ExpertFormat.parse("int4", 64))
    meta = json.loads((tmp_path / "experts.json").read_text())
    (tmp_path / "experts.json").write_text(json.dumps(meta | change))
    with pytest.raises(CheckpointError, match="corrupted.*rerun `expertcache convert`"):
        DiskStore(tmp_path, args)


def test_a_store_in_another_format_is_refused(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["qwen2_moe"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path, fmt=ExpertFormat.parse("int8", 64))
    with pytest.raises(CheckpointError, match="int8-g64-asym, not int4-g64-asym"):
        open_store("disk", ckpt, args, tmp_path, fmt=ExpertFormat.parse("int4", 64))
