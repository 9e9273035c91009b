"""MXFP4 as a disk-store format: the encoder against a reference and HF's decoder, its error bound,
4.25 bits per weight, a GPT-OSS store that serves exactly what its ram emulation holds, and a
released-style MXFP4 checkpoint converted without requantising."""
import json

import pytest
import torch
from hf_models import quantize_mxfp4, save_gpt_oss_mxfp4

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.quant import (
    ExpertFormat,
    encoded_bytes,
    error_bound,
    float_to_mxfp4,
    layout,
    mxfp4_to_float,
    roundtrip,
    unpack_mxfp4,
)
from expertcache.engine.stores import ALIGN, DiskStore, ExpertShape
from expertcache.models import model_args

MXFP4 = ExpertFormat.parse("mxfp4")


def test_mxfp4_round_trip_is_within_half_an_fp4_step():
    """Gaussian weights move by at most half the FP4 spacing times the block's scale (and by something);
    the codes equal a reference encoder's and HF's decoder reads them; decoded weights encode to themselves."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    w = torch.randn(48, 320, generator=torch.Generator().manual_seed(0))
    back = roundtrip(w, MXFP4)
    err = (back - w).abs()
    assert (err <= error_bound(w, MXFP4)).all() and err.max() > 0.1
    assert 0.08 < ((back - w).norm() / w.norm()).item() < 0.15  # ~11.7% relative RMS error on Gaussian weights
    assert (err > error_bound(w, ExpertFormat.parse("int8", 32))).any()
    blocks, scales = float_to_mxfp4(w)
    ref_blocks, ref_scales = quantize_mxfp4(w)  # no exact ties in Gaussian data: the same values (-0 and +0 aside)
    assert torch.equal(scales, ref_scales) and torch.equal(mxfp4_to_float(blocks, scales),
                                                           mxfp4_to_float(ref_blocks, ref_scales))
    hf = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0]  # [in, out]
    assert torch.equal(hf.t(), mxfp4_to_float(blocks, scales)) and torch.equal(hf.t(), back)
    assert torch.equal(roundtrip(back, MXFP4), back)


def test_mxfp4_scale_never_clips_and_ties_round_away_from_zero():
    """A block's scale is amax / 6 rounded up to a power of two (7 -> scale 2, 6 at most 8 -> no clipping);
    values halfway between two FP4 values go to the larger magnitude, as HF's conversion does."""
    w = torch.zeros(1, 32)
    w[0, :5] = torch.tensor([7.0, 0.5, -0.5, 2.5, -5.0])  # / scale 2: 3.5, 0.25, -0.25, 1.25, -2.5
    _, scales = float_to_mxfp4(w)
    assert scales.item() == 128  # 2 ** (128 - 127)
    assert roundtrip(w, MXFP4)[0, :5].tolist() == [8.0, 1.0, -1.0, 3.0, -6.0]
    assert torch.equal(roundtrip(torch.zeros(3, 64), MXFP4), torch.zeros(3, 64))


def test_mxfp4_bytes_per_expert():
    """GPT-OSS's expert (H = F = 2880, biases): 4.25 bits per weight, fp32 biases, 16-byte segment alignment;
    a blob pads that to 4 KiB. Inputs that are not whole blocks are padded to 32."""
    shape = ExpertShape(1, 1, (2 * 2880, 2880), (2880, 2880), bias=True)
    weights = 3 * 2880 * 2880
    assert encoded_bytes(shape.parts, MXFP4) == weights * 4.25 / 8 + 4 * (2 * 2880 + 2880) == 13_253_760
    odd = [(24, 40), (40, 12)]  # 40 inputs -> 2 blocks, 12 -> 1; 24 rows -> 2 row blocks of 16, 40 -> 3
    segs = layout(odd, MXFP4)
    assert [(s.role, s.shape) for s in segs] == [("codes", (2, 512)), ("scales", (2, 32)), ("codes", (3, 256)),
                                                 ("scales", (3, 16))]
    assert all(s.offset % 16 == 0 for s in segs)
    assert encoded_bytes(odd, MXFP4) == 1024 + 64 + 768 + 48


def test_gpt_oss_mxfp4_disk_store_equals_its_ram_emulation(tiny, tmp_path):
    """The same tiny GPT-OSS through an mxfp4 disk store (fetch-every-miss) and through the ram store's
    mxfp4 emulation: equal logits, prefill and decode; not the float model's."""
    path, _ = tiny["gpt_oss"]
    ids = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(2))
    out = {}
    for store in ("disk", "ram", "exact"):
        fmt = None if store == "exact" else MXFP4
        engine = Engine(path, EngineConfig(store="ram" if store == "exact" else store, store_format=fmt,
                                           store_dir=tmp_path / "store" if store == "disk" else None,
                                           cache=CacheConfig(fraction=0.25), initial="cold"))
        out[store] = torch.cat([engine.forward(ids[:8], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(8, 16)])
        assert engine.stats.sync_fetches > 0
        if store == "disk":
            blob = json.loads((tmp_path / "store" / "experts.json").read_text())["blob_bytes"]
            assert engine.store.expert_bytes == blob == ALIGN  # 3 x 32 x 16 weights at 4.25 bits + biases: 4 KiB
        engine.close()
    assert torch.equal(out["disk"], out["ram"])
    assert not torch.allclose(out["disk"], out["exact"], atol=1e-3)


def test_mxfp4_checkpoint_converts_as_is(tmp_path, capsys):
    """`convert --dtype mxfp4` of a checkpoint in MXFP4 writes its blocks and scales as they are, repacked into
    the kernel's row blocks (rows in our gate-then-up order), and the engine on that store matches HF on the
    same codes."""
    from safetensors.torch import load_file
    model = tmp_path / "model"
    hf = save_gpt_oss_mxfp4(model)
    out = tmp_path / "store"
    assert cli.main(["convert", "--model", str(model), "--dtype", "mxfp4", "--out", str(out)]) == 0
    assert "(mxfp4, 4096 bytes each)" in capsys.readouterr().out
    args = model_args(open_checkpoint(model).config)
    disk = DiskStore(out, args)
    state = load_file(str(model / "model.safetensors"))
    segs = layout(disk.shape.parts, MXFP4)
    for layer in range(args.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = state[p + "gate_up_proj_blocks"], state[p + "gate_up_proj_scales"]  # rows g0 u0 g1 u1 ...
        for e in range(args.num_experts):
            view = torch.from_numpy(disk._read(layer, e))
            stored = {(s.part, s.role): view[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in segs}
            blocks, scales = (torch.cat([t[e, 0::2], t[e, 1::2]]) for t in gate_up)
            for part, (b, sc) in enumerate([(blocks, scales), (state[p + "down_proj_blocks"][e],
                                                               state[p + "down_proj_scales"][e])]):
                got_b, got_sc = unpack_mxfp4(stored[part, "codes"], stored[part, "scales"], b.shape[0])
                assert torch.equal(got_b, b) and torch.equal(got_sc, sc)
    disk.close()
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    engine = Engine(model, EngineConfig(store="disk", store_dir=out, store_format=MXFP4,
                                        cache=CacheConfig(fraction=0.25), initial="cold"))
    torch.testing.assert_close(engine.forward(ids, 0), ref, atol=1e-4, rtol=0)
    engine.close()


def test_mxfp4_is_a_store_dtype(tiny, tmp_path):
    """`--store-dtype mxfp4` runs the engine on an mxfp4 disk store; that store is refused as another format."""
    import argparse

    from expertcache.commands.options import add_engine_arguments, engine_from_args
    from expertcache.errors import CheckpointError
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    common = ["--model", str(tiny["gpt_oss"][0]), "--store", "disk", "--store-dir", str(tmp_path), "--cache", "0.5"]
    engine = engine_from_args(p.parse_args([*common, "--store-dtype", "mxfp4"]))
    assert engine.store.format == MXFP4 and json.loads((tmp_path / "experts.json").read_text())["dtype"] == "mxfp4"
    assert torch.isfinite(engine.forward(torch.arange(8), 0)).all() and engine.stats.sync_fetches > 0
    engine.close()
    with pytest.raises(CheckpointError, match="holds experts as mxfp4, not int4-g32-asym"):
        engine_from_args(p.parse_args([*common, "--store-dtype", "int4"]))


@pytest.mark.parametrize("change", [{"group_size": 64}, {"scheme": "asym"}])
def test_corrupted_mxfp4_header_is_refused(tiny, tmp_path, change):
    from expertcache.engine.stores import convert_to_disk
    from expertcache.errors import CheckpointError
    ckpt = open_checkpoint(tiny["gpt_oss"][0])
    args = model_args(ckpt.config)
    convert_to_disk(ckpt, args, tmp_path, fmt=MXFP4)
    meta = json.loads((tmp_path / "experts.json").read_text())
    (tmp_path / "experts.json").write_text(json.dumps({**meta, **change}))
    with pytest.raises(CheckpointError, match="not a known expert format"):
        DiskStore(tmp_path, args)
