"""The slow tiers: the disk store reads what the ram store holds, with O_DIRECT, from a file
converted once; a failed or short read, or a blob that fails its checksum, is an error, never
stale or corrupt weights; where O_DIRECT is refused, reads are buffered and say so."""
import errno
import json
import os

import crc32c
import pytest
import torch

from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.stores import (
    DISK_FORMAT_VERSION,
    DiskStore,
    RamStore,
    convert_to_disk,
    default_store_dir,
    open_store,
    store_format,
)
from expertcache.errors import CheckpointError, FetchError, ReadModeUnsupported, UnknownName
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


def test_each_blob_has_its_checksum(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["olmoe"][0])
    args = model_args(ckpt.config)
    disk = DiskStore(convert_to_disk(ckpt, args, tmp_path), args)
    meta = json.loads((tmp_path / "experts.json").read_text())
    assert meta["format_version"] == DISK_FORMAT_VERSION and meta["checksum"] == "crc32c"
    data = (tmp_path / "experts.bin").read_bytes()
    assert [crc32c.crc32c(data[i:i + disk.blob]) for i in range(0, len(data), disk.blob)] == meta["checksums"]
    with open(tmp_path / "experts.bin", "r+b") as f:  # one flipped bit in the padding of the last blob
        f.seek(len(data) - 1)
        f.write(b"\x01")
    w13, w2 = torch.empty(disk.shape.w13), torch.empty(disk.shape.w2)
    disk.read_into(0, 0, w13, w2)
    with pytest.raises(FetchError, match=f"expert {args.num_experts - 1} of layer {args.num_layers - 1} fails"):
        disk.read_into(args.num_layers - 1, args.num_experts - 1, w13, w2)
    DiskStore(tmp_path, args, verify=False).read_into(args.num_layers - 1, args.num_experts - 1, w13, w2)


def test_older_store_refused_or_reconverted(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["mixtral"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path)
    meta = json.loads((tmp_path / "experts.json").read_text())
    (tmp_path / "experts.json").write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(CheckpointError, match="rerun `expertcache convert`"):
        open_store("disk", ckpt, args, tmp_path)  # a folder the user named is not rewritten unasked
    default = default_store_dir(ckpt)
    convert_to_disk(ckpt, args, default)
    (default / "experts.json").write_text(json.dumps({**meta, "format_version": 1}))
    assert open_store("disk", ckpt, args).checksums.tolist() == meta["checksums"]
    assert store_format(default) == DISK_FORMAT_VERSION


def refuse_o_direct(monkeypatch):
    """The filesystem's answer on tmpfs before Linux 6.6, or on some FUSE and network filesystems."""
    real = os.open

    def open_(path, flags, *rest):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real(path, flags, *rest)
    monkeypatch.setattr(os, "open", open_)


@pytest.mark.parametrize("refusal", ["filesystem", "platform"])
def test_without_o_direct_reads_are_buffered_and_reported(tiny, tmp_path, monkeypatch, refusal):
    ckpt = open_checkpoint(tiny["qwen3_moe"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path)
    if refusal == "filesystem":
        refuse_o_direct(monkeypatch)
    else:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    with pytest.raises(ReadModeUnsupported, match="read mode 'auto' or 'buffered'"):
        DiskStore(tmp_path, args, read_mode="direct")
    dropped = []
    fadvise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: dropped.append(a) or fadvise(*a))
    disk = DiskStore(tmp_path, args)  # auto
    assert disk.read_mode == "buffered-dontneed"
    ram = RamStore(ckpt, args)
    w13, w2 = torch.empty(ram.shape.w13), torch.empty(ram.shape.w2)
    disk.read_into(1, 3, w13, w2)
    assert torch.equal(w13, ram.w13[1, 3]) and torch.equal(w2, ram.w2[1, 3])
    assert dropped == [(disk.fd, 0, 0, os.POSIX_FADV_RANDOM),  # no readahead of neighbouring blobs
                       (disk.fd, (args.num_experts + 3) * disk.blob, disk.blob, os.POSIX_FADV_DONTNEED)]


def test_read_mode_in_the_run_stats(tiny, tmp_path, capsys):
    path = tiny["qwen3_moe"][0]
    store = convert_to_disk(open_checkpoint(path), model_args(open_checkpoint(path).config), tmp_path / "store")
    expected = "o_direct"
    try:  # the expected mode where the test runs: O_DIRECT if this filesystem takes it
        os.close(os.open(store / "experts.bin", os.O_RDONLY | os.O_DIRECT))
    except (AttributeError, OSError):
        expected = "buffered-dontneed"
    disk = Engine(path, EngineConfig(store="disk", store_dir=store, read_mode="auto"))
    disk.forward(torch.arange(4), 0)
    assert disk.stats.to_dict()["read_mode"] == expected and disk.stats.line().endswith(f"reads: {expected}")
    buffered = Engine(path, EngineConfig(store="disk", store_dir=store, read_mode="buffered"))
    assert buffered.stats.read_mode == "buffered-dontneed"
    assert Engine(path).stats.read_mode == "ram"
    with pytest.raises(UnknownName, match="unknown read mode 'fast'"):
        Engine(path, EngineConfig(store="disk", store_dir=store, read_mode="fast"))
