"""The slow tiers: the disk store reads what the ram store holds, with O_DIRECT, from a file
converted once, as is or quantized; a failed or short read, or a blob that fails its checksum,
is an error, never stale or corrupt weights; where O_DIRECT is refused, reads are buffered and say so."""
import errno
import json
import os

import crc32c
import numpy as np
import pytest
import torch

from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.quant import (
    FLOAT_DTYPES,
    ExpertFormat,
    decode_into,
    decode_plan,
    encode,
    encoded_bytes,
    error_bound,
    roundtrip,
)
from expertcache.engine.stores import (
    DISK_FORMAT_VERSION,
    DiskStore,
    RamStore,
    convert_to_disk,
    default_store_dir,
    format_store_dir,
    open_store,
    store_format,
)
from expertcache.errors import (
    BadInput,
    CheckpointError,
    FetchError,
    NotEnoughDisk,
    ReadModeUnsupported,
    UnknownName,
)
from expertcache.kernel.decode_blob import NO_PART, decode_blob
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


def test_a_store_larger_than_the_free_disk_is_refused_before_writing(tiny, tmp_path):
    """A conversion that would run out of disk space is refused at once, naming the sizes, where it failed near its
    end (tens of GB into a real model's); it leaves no file. A real small filesystem: a tmpfs, where one can be
    mounted."""
    import subprocess
    ckpt = open_checkpoint(tiny["qwen2_moe"][0])
    args = model_args(ckpt.config)
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("no tmpfs can be mounted here (needs root)")
    try:
        with pytest.raises(NotEnoughDisk, match=r"needs .* free; free disk space"):
            convert_to_disk(ckpt, args, small / "store")
        assert not any((small / "store").iterdir())
    finally:
        subprocess.run(["umount", str(small)], check=True)


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


def test_a_finished_store_is_on_disk_names_and_all(tiny, tmp_path, monkeypatch):
    """A conversion ends with its header's bytes and both files' names in the folder synced to the disk: renames
    that only the page cache held, lost to a power cut, would take away a store that took hours to write."""
    real, synced = os.fsync, []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    ckpt = open_checkpoint(tiny["olmoe"][0])
    convert_to_disk(ckpt, model_args(ckpt.config), tmp_path)
    assert synced[-2:] == [str(tmp_path / "experts.json.partial"), str(tmp_path)]



def test_convert_leaves_a_current_store_as_it_is(tiny, tmp_path, capsys):
    """`convert` into a folder that holds this checkpoint's experts in this format, converted from its files as they
    are, writes nothing (it rewrote the whole store each time: minutes at real size); another format, a weight
    file changed since, or --force converts again."""
    import shutil

    from expertcache import cli
    model, store = tmp_path / "model", tmp_path / "store"
    shutil.copytree(tiny["mixtral"][0], model)
    convert = ["convert", "--model", str(model), "--out", str(store)]

    def written(*flags):
        before = (store / "experts.bin").stat().st_mtime_ns if (store / "experts.bin").exists() else None
        assert cli.main([*convert, *flags]) == 0
        out = capsys.readouterr().out
        assert ("nothing written" in out) == ((store / "experts.bin").stat().st_mtime_ns == before), out
        return "nothing written" not in out
    assert written() and not written() and written("--dtype", "int4") and not written("--dtype", "int4")
    assert written("--dtype", "int4", "--force") and written()
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert written() and not written()

def test_older_store_refused_or_reconverted(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["mixtral"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path)
    meta = json.loads((tmp_path / "experts.json").read_text())
    (tmp_path / "experts.json").write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(CheckpointError, match="rerun `expertcache convert --force --out") as e:
        open_store("disk", ckpt, args, tmp_path)  # a folder the user named is not rewritten unasked
    # the fix names the folder: convert without --out wrote the default one and left this one as it was
    assert f"--out {tmp_path}`" in str(e.value)
    from expertcache import cli
    assert cli.main(["convert", "--model", str(ckpt.path), "--out", str(tmp_path)]) == 0
    open_store("disk", ckpt, args, tmp_path).close()
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
    assert [d for d in dropped if d[0] == disk.fd] == [  # the checkpoint's reads drop their pages too
        (disk.fd, 0, 0, os.POSIX_FADV_RANDOM),  # no readahead of neighbouring blobs
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
    assert disk.stats.to_dict()["read_mode"] == expected and f"reads: {expected}, kernels: " in disk.stats.line()
    buffered = Engine(path, EngineConfig(store="disk", store_dir=store, read_mode="buffered"))
    assert buffered.stats.read_mode == "buffered-dontneed"
    assert Engine(path).stats.read_mode == "ram"
    with pytest.raises(UnknownName, match="unknown read mode 'fast'"):
        Engine(path, EngineConfig(store="disk", store_dir=store, read_mode="fast"))


@pytest.mark.parametrize("dtype,group,scheme", [("float16", 0, ""), ("bfloat16", 0, ""), ("int8", 16, "asym"),
                                                ("int4", 16, "asym"), ("int4", 32, "sym"), ("int8", 24, "sym"),
                                                ("mxfp4", 0, "")])
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


@pytest.mark.parametrize("dtype,group,scheme", [("fp16", 0, ""), ("bf16", 0, ""), ("fp32", 0, ""),
                                                ("int8", 8, "asym"), ("int8", 24, "sym"), ("int4", 8, "asym"),
                                                ("int4", 16, "sym"), ("mxfp4", 0, "")])
def test_compiled_decoder_equals_the_torch_reference(dtype, group, scheme):
    """kernel.decode_blob writes bit for bit what quant.decode_into writes, for every format: parts
    with biases and odd input counts (padded groups), fp16 specials (signed zeros, subnormals, inf,
    values past fp16's range), symmetric and asymmetric codes."""
    torch.manual_seed(0)
    parts = [(10, 37), (37, 5), (10,), (37,)]
    tensors = [torch.randn(p) * 0.05 for p in parts]
    tensors[0].view(-1)[:8] = torch.tensor([0.0, -0.0, 1e-7, -3e-6, 7e4, -1e5, float("inf"), 2.0 ** -20])
    tensors[1][3] = 0.0  # all-zero groups: a zero scale
    fmt = ExpertFormat.parse(dtype, group, scheme or "asym")
    if fmt.quantized:
        tensors[0].view(-1)[6] = 1.0  # no inf in a group's range
    if fmt.mx:
        tensors[1][:, :5] *= 2.0 ** -130  # blocks whose scale is subnormal or tiny
    blob = (encoded_bytes(parts, fmt) + 4095) // 4096 * 4096
    buf = np.frombuffer(encode(tensors, parts, fmt, blob, finite=False), np.uint8).copy()
    want = [torch.empty(p) for p in parts]
    decode_into(torch.from_numpy(buf), parts, fmt, want)
    got = [torch.full(p, float("nan")) for p in parts]
    decode_blob(buf, decode_plan(parts, fmt), *[t.view(-1).numpy() for t in got])
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    two = [torch.full(p, float("nan")) for p in parts[:2]]  # a family without biases: a plan of two parts
    decode_blob(buf, decode_plan(parts[:2], fmt), *[t.view(-1).numpy() for t in two], NO_PART, NO_PART)
    assert all(torch.equal(g, w) for g, w in zip(two, want))


@pytest.mark.parametrize("change", [{"dtype": "int3"}, {"group_size": 0}, {"group_size": "64"},
                                    {"scheme": "nf4"}, {"blob_bytes": 8192}, {"dtype": "float16"}])
def test_corrupted_format_header_is_refused(tiny, tmp_path, change):
    ckpt = open_checkpoint(tiny["qwen2_moe"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path, fmt=ExpertFormat.parse("int4", 64))
    meta = json.loads((tmp_path / "experts.json").read_text())
    (tmp_path / "experts.json").write_text(json.dumps(meta | change))
    with pytest.raises(CheckpointError, match="corrupted.*rerun `expertcache convert --force --out"):
        DiskStore(tmp_path, args)


def test_an_experts_json_of_other_bytes_or_a_float_size_is_no_traceback(tiny, tmp_path):
    """experts.json in another encoding is corrupt, one line; a blob size written as 61440.0 (the format's size) was
    taken as the stride of every read and ended in a TypeError inside the reads."""
    ckpt = open_checkpoint(tiny["qwen2_moe"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path)
    text = (tmp_path / "experts.json").read_text()
    meta = json.loads(text)
    (tmp_path / "experts.json").write_bytes(text.encode("utf-16"))
    with pytest.raises(CheckpointError,
                       match="no valid experts.json .*utf-8.*; rerun `expertcache convert --force --out"):
        DiskStore(tmp_path, args)
    (tmp_path / "experts.json").write_text(json.dumps({**meta, "blob_bytes": float(meta["blob_bytes"])}))
    disk = DiskStore(tmp_path, args)
    w13, w2 = torch.empty(disk.shape.w13), torch.empty(disk.shape.w2)
    assert disk.read_into(1, 3, w13, w2) == meta["blob_bytes"] and type(disk.blob) is int
    assert torch.equal(w13, RamStore(ckpt, args).w13[1, 3])
    disk.close()


def test_a_store_in_another_format_is_refused(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["qwen2_moe"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path, fmt=ExpertFormat.parse("int8", 64))
    with pytest.raises(CheckpointError, match="int8-g64-asym, not int4-g64-asym") as e:
        open_store("disk", ckpt, args, tmp_path, fmt=ExpertFormat.parse("int4", 64))
    # the command it names writes the format asked for (it named torch's dtype, which convert refuses)
    assert f"`expertcache convert --model {ckpt.path} --dtype int4 --group-size 64 --out DIR`" in str(e.value)
    for fmt in ("fp16", "bf16", "int8", "mxfp4"):
        assert ExpertFormat.parse(ExpertFormat.parse(fmt).flags.split()[0]) == ExpertFormat.parse(fmt)
    assert ExpertFormat.parse("int4", 32, "sym").flags == "int4 --scheme sym"


@pytest.mark.parametrize("fmt", [None, "int4"])
def test_a_store_of_another_checkpoint_of_the_same_shape_is_refused(tiny, tmp_path, fmt):
    """A --store-dir converted from another checkpoint of the same shape (a fine-tune) would serve its experts
    with this one's dense weights: refused in one line. The same weights at another path are accepted."""
    import shutil

    from safetensors.torch import load_file, save_file
    src = tiny["qwen3_moe"][0]
    form = ExpertFormat.parse(fmt, 16) if fmt else None
    Engine(src, EngineConfig(store="disk", store_dir=tmp_path / "store", store_format=form)).close()
    copy, tuned = tmp_path / "copy", tmp_path / "tuned"
    shutil.copytree(src, copy)
    shutil.copytree(src, tuned)
    sd = load_file(tuned / "model.safetensors")
    sd["model.layers.0.mlp.experts.0.up_proj.weight"] += 0.5
    save_file(sd, tuned / "model.safetensors")
    Engine(copy, EngineConfig(store="disk", store_dir=tmp_path / "store", store_format=form)).close()
    with pytest.raises(CheckpointError, match="holds another checkpoint's experts"):
        Engine(tuned, EngineConfig(store="disk", store_dir=tmp_path / "store", store_format=form))


def test_the_default_store_of_weights_replaced_with_their_size_and_time_is_converted_again(tiny, tmp_path,
                                                                                           monkeypatch):
    """The default store's folder is named by its weight files' paths, sizes and times, which a copy can keep
    (cp -p, rsync -t): other weights put in place that way were served the old experts, silently. Their first
    expert's checksum differs, and the store is converted again: the engine computes the new weights."""
    import os
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    monkeypatch.setenv("EXPERTCACHE_HOME", str(tmp_path / "home"))
    src = tmp_path / "model"
    shutil.copytree(tiny["qwen3_moe"][0], src)
    ids = torch.tensor([1, 5, 9, 2])
    engine = Engine(src, EngineConfig(store="disk"))
    before = engine.forward(ids, 0)
    engine.close()
    file = src / "model.safetensors"
    st = file.stat()
    sd = load_file(file)
    with safe_open(file, "pt") as f:
        metadata = f.metadata()
    for name in sd:
        if ".experts." in name:
            sd[name] = sd[name].flip(0).contiguous()  # other values, the same size
    save_file(sd, file, metadata)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file.stat().st_size == st.st_size
    disk, ram = (Engine(src, EngineConfig(store=store)) for store in ("disk", "ram"))
    after = disk.forward(ids, 0)
    assert torch.equal(after, ram.forward(ids, 0)) and not torch.equal(after, before)
    disk.close()
    ram.close()


def test_a_default_store_of_the_weights_as_they_were_is_removed_when_they_are_converted_again(tiny, tmp_path,
                                                                                               monkeypatch, capsys):
    """A default store's folder is named by its weight files' sizes and times: an edited or downloaded-again
    checkpoint is converted into a folder of its own, and the old one (tens of GB at real size) was never used or
    removed again. Converting the weights as they are now removes the stores of them as they were, in every
    format, before it writes its own where it needs their space; a store of another folder's checkpoint, and one still
    read, are kept (the run keeps its open file)."""
    import os
    import shutil
    monkeypatch.setenv("EXPERTCACHE_HOME", str(tmp_path / "home"))
    src, other = tmp_path / "model", tmp_path / "elsewhere" / "model"
    shutil.copytree(tiny["qwen3_moe"][0], src)
    shutil.copytree(tiny["qwen3_moe"][0], other)
    ids = torch.tensor([1, 5, 9, 2])
    running = Engine(src, EngineConfig(store="disk"))
    want = running.forward(ids, 0)
    Engine(src, EngineConfig(store="disk", store_format="int8")).close()
    Engine(other, EngineConfig(store="disk")).close()
    stores = tmp_path / "home" / "stores"
    ckpt = open_checkpoint(src)
    convert_to_disk(ckpt, model_args(ckpt.config), stores / "model-keep")  # a folder the user named (--out)
    before = sorted(p.name for p in stores.iterdir())
    assert len(before) == 4
    capsys.readouterr()
    file = src / "model.safetensors"
    touch = lambda: os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))  # noqa: E731
    touch()  # as a download does
    convert_to_disk(open_checkpoint(src), model_args(ckpt.config), tmp_path / "mine")  # the user's: nothing removed
    assert sorted(p.name for p in stores.iterdir()) == before
    import expertcache.engine.stores.convert as convert
    real, left = convert.encode, []
    monkeypatch.setattr(convert, "encode", lambda *a: left.append(sorted(p.name for p in stores.iterdir())) or real(*a))
    monkeypatch.setattr(convert.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(0, 0, 0))  # a full disk
    Engine(src, EngineConfig(store="disk")).close()
    after = sorted(p.name for p in stores.iterdir())
    old = [stores / name for name in before if name not in after]
    # removed before the new store is written where the disk holds no more: their space is what it needs (a
    # re-downloaded model on a disk of one store failed every run); with room, once it is written
    assert not any(p.name in left[0] for p in old), left[0]
    # the two default ones of the weights as they were; the other folder's and the one the user named kept
    assert len(old) == 2 and len(after) == 3 and "model-keep" in after
    err = capsys.readouterr().err
    assert all(f"removed {p} (" in err for p in old), err
    assert torch.equal(running.forward(ids, 0), want)  # a run of the old store reads its open file on
    running.close()


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
def test_weights_past_float16s_range_are_refused_not_stored_as_inf(tiny, tmp_path, fmt):
    """An fp16 store, and the float16 scales of int8 and int4, cannot hold a weight of 4e5: it was written as inf,
    and every run then called the store damaged, converting again the same. Refused as the conversion meets it,
    naming a format that holds it; bf16 does."""
    import shutil

    from safetensors.torch import load_file, save_file
    src = tmp_path / "model"
    shutil.copytree(tiny["qwen3_moe"][0], src)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.mlp.experts.3.down_proj.weight"][0, 0] = -4e5  # an asymmetric group's minimum
    save_file(sd, src / "model.safetensors")
    ckpt = open_checkpoint(src)
    args = model_args(ckpt.config)
    form = ExpertFormat.parse(fmt, 16) if fmt != "fp16" else ExpertFormat("float16")
    with pytest.raises(BadInput, match="reach 4e\\+05, past what .* holds .*bf16"):
        convert_to_disk(ckpt, args, tmp_path / "store", fmt=form)
    DiskStore(convert_to_disk(ckpt, args, tmp_path / "bf16", fmt=ExpertFormat("bfloat16")), args).close()


def test_quantized_blobs_carry_their_checksum(tiny, tmp_path):
    """An int4 store's blobs get the CRC32C of their encoded bytes; a flipped code byte is caught."""
    ckpt = open_checkpoint(tiny["qwen2_moe"][0])
    args = model_args(ckpt.config)
    disk = DiskStore(convert_to_disk(ckpt, args, tmp_path, fmt=ExpertFormat.parse("int4", 16)), args)
    meta = json.loads((tmp_path / "experts.json").read_text())
    assert meta["format_version"] == DISK_FORMAT_VERSION and meta["dtype"] == "int4"
    data = (tmp_path / "experts.bin").read_bytes()
    assert [crc32c.crc32c(data[i:i + disk.blob]) for i in range(0, len(data), disk.blob)] == meta["checksums"]
    offset = (1 * args.num_experts + 2) * disk.blob  # the first code byte of expert 2 of layer 1
    with open(tmp_path / "experts.bin", "r+b") as f:
        f.seek(offset)
        f.write(bytes([data[offset] ^ 0x01]))
    slot = [torch.empty(p) for p in disk.shape.parts]
    with pytest.raises(FetchError, match="expert 2 of layer 1 fails its CRC32C check"):
        disk.read_into(1, 2, *slot)
    DiskStore(tmp_path, args, verify=False).read_into(1, 2, *slot)


def test_older_format_store_refused_or_reconverted(tiny, tmp_path):
    """A quantized store of an older version: refused in a named folder, reconverted in its default one."""
    ckpt = open_checkpoint(tiny["mixtral"][0])
    args = model_args(ckpt.config)
    fmt = ExpertFormat.parse("int8", 16)
    convert_to_disk(ckpt, args, tmp_path, fmt=fmt)
    meta = json.loads((tmp_path / "experts.json").read_text())
    (tmp_path / "experts.json").write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(CheckpointError, match="rerun `expertcache convert --force --out"):
        open_store("disk", ckpt, args, tmp_path, fmt=fmt)
    default = format_store_dir(ckpt, fmt)
    convert_to_disk(ckpt, args, default, fmt=fmt)
    (default / "experts.json").write_text(json.dumps({**meta, "format_version": 1}))
    store = open_store("disk", ckpt, args, fmt=fmt, read_mode="buffered", verify=False)
    assert store.format == fmt and store_format(default) == DISK_FORMAT_VERSION
    assert store.read_mode == "buffered-dontneed" and not store.verify


def test_lowbit_small_copies_use_the_read_mode_and_checks(tiny, tmp_path):
    path = tiny["qwen3_moe"][0]
    engine = Engine(path, EngineConfig(store="disk", store_dir=tmp_path, read_mode="buffered", policy="lowbit:tau=0.3",
                                       cache=CacheConfig(fraction=0.25), initial="cold"))
    small = engine.cache.small
    assert small.format == engine.config.small_format and small.read_mode == engine.store.read_mode
    assert small.verify and engine.store.verify
    engine.forward(torch.arange(8), 0)
    assert engine.stats.lowbit_fetches > 0


def _open_store_after(barrier, home: str) -> None:
    """A process that opens the built-in model's default disk store once `barrier` lets every process go."""
    os.environ["EXPERTCACHE_HOME"] = home
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.engine.stores import open_store
    ckpt = open_checkpoint(BUILTIN_MODEL)
    barrier.wait()
    open_store("disk", ckpt, model_args(ckpt.config)).close()


def test_two_processes_converting_one_store_at_once(tmp_path, monkeypatch):
    """Two runs that start together on a fresh machine (a server and a generate) convert the default store
    once between them: the second waits for the first's conversion, and both find a whole, checked store."""
    import multiprocessing as mp

    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.engine.stores import DiskStore, format_store_dir
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_open_store_after, args=(barrier, str(tmp_path))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    monkeypatch.setenv("EXPERTCACHE_HOME", str(tmp_path))
    ckpt = open_checkpoint(BUILTIN_MODEL)
    args = model_args(ckpt.config)
    store = DiskStore(format_store_dir(ckpt, None), args)
    for layer in range(args.num_moe_layers):  # each read checks its blob's checksum
        for e in range(args.num_experts):
            store.read_into(layer, e, torch.empty(store.shape.w13), torch.empty(store.shape.w2))
    store.close()


def test_a_store_of_this_checkpoint_before_an_edit_is_refused(tiny, tmp_path):
    """A --store-dir converted before an expert of its checkpoint changed (one past the first, which the match
    above encodes again) served the old expert silently: refused in one line naming the file and the command."""
    import shutil

    from safetensors.torch import load_file, save_file
    src = tmp_path / "model"
    shutil.copytree(tiny["qwen3_moe"][0], src)
    Engine(src, EngineConfig(store="disk", store_dir=tmp_path / "store")).close()
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.mlp.experts.5.up_proj.weight"] += 0.5
    save_file(sd, src / "model.safetensors")
    with pytest.raises(CheckpointError, match="sizes or times differ .*model.safetensors.*`expertcache convert --model"):
        Engine(src, EngineConfig(store="disk", store_dir=tmp_path / "store"))


def test_a_model_folder_whose_name_is_not_utf8_gets_its_default_store(tiny, tmp_path, monkeypatch):
    """A folder name of bytes that are not UTF-8 (Latin-1's é) reaches Python as surrogates, which the store's
    digest encoded in a UnicodeEncodeError's traceback; the digest of any other path is as it was."""
    import hashlib
    import os
    import shutil

    from expertcache.engine.stores.convert import default_store_dir
    monkeypatch.setenv("EXPERTCACHE_HOME", str(tmp_path / "home"))
    src = tmp_path / os.fsdecode(b"lat\xe9")
    shutil.copytree(tiny["qwen3_moe"][0], src)
    engine = Engine(src, EngineConfig(store="disk"))
    assert engine.forward(torch.tensor([1, 2]), 0).isfinite().all()
    engine.close()
    ckpt = open_checkpoint(tiny["qwen3_moe"][0])
    h = hashlib.sha1()
    for f in sorted(set(ckpt.files.values())):
        h.update(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    assert default_store_dir(ckpt).name.endswith(h.hexdigest()[:12])


def test_a_run_waiting_for_another_processes_conversion_says_so(tmp_path, capsys):
    """A second run waited on the first's conversion (minutes for a real model) without a word: a hang to its user."""
    import fcntl
    import threading

    from expertcache.engine.stores.convert import conversion_lock
    (tmp_path / "store").mkdir()
    held = open(tmp_path / "store" / ".convert.lock", "a")  # noqa: SIM115 -- another process's lock, held here
    fcntl.flock(held, fcntl.LOCK_EX)
    done = []

    def convert():
        with conversion_lock(tmp_path / "store"):
            done.append(1)
    waiting = threading.Thread(target=convert)
    waiting.start()
    waiting.join(1)
    assert not done and f"waiting for another process converting into {tmp_path / 'store'}" in capsys.readouterr().err
    held.close()
    waiting.join(30)
    assert done
    with conversion_lock(tmp_path / "store"):  # free: nothing said
        pass
    assert capsys.readouterr().err == ""
