"""sftrecipes.export.dcp reads DCP chunks straight into the output tensor (no torch.load), falls back to torch.load for
layouts it does not know, and turns damaged or incomplete checkpoints into one-line errors. The FSDP1/FSDP2 twins'
real multi-rank checkpoints are read the same way in test_export.py. Last, the export writer's threaded hashing."""

import pickle
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sftrecipes.export import dcp as dcpio  # torch.distributed.checkpoint is `dcp` here
from sftrecipes.core.errors import RecipeError


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 4, generator=g), "h": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "ids": torch.arange(7), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3), "mask": torch.tensor([True, False, True])}


@pytest.fixture
def ckpt(tmp_path):
    dcp.save({f"model.{k}": v for k, v in tensors().items()}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    return tmp_path


def no_torch_load(*a, **k):
    raise AssertionError("torch.load was called: the chunk was not read directly")


def test_every_tensor_is_read_directly_and_exactly(ckpt):
    src = dcpio.DCPSource(ckpt)
    assert sorted(src.names()) == sorted(tensors())
    with mock.patch.object(torch, "load", no_torch_load):
        for k, v in tensors().items():
            got = src.get(k)
            assert src.meta(k) == (v.dtype, tuple(v.shape)) and got.dtype == v.dtype and torch.equal(got, v), k


def test_a_strided_destination_is_filled_through_a_copy(ckpt):
    """A chunk split along a later dimension lands in a non-contiguous view of the output."""
    src = dcpio.DCPSource(ckpt)
    (_, _, info), = src.pieces["model.w"]
    dest = torch.empty(4, 6).t()
    assert not dest.is_contiguous()
    with mock.patch.object(torch, "load", no_torch_load):
        src.read_chunk(info, dest, "w")
    assert torch.equal(dest, tensors()["w"])


def test_an_unknown_layout_falls_back_to_torch_load(ckpt):
    src = dcpio.DCPSource(ckpt)
    with mock.patch.object(dcpio, "_plain_layout", side_effect=dcpio._NotPlain("test")):
        for k, v in tensors().items():
            assert torch.equal(src.get(k), v), k


def test_a_damaged_chunk_is_a_one_line_error(ckpt):
    src = dcpio.DCPSource(ckpt)
    (_, _, info), = src.pieces["model.w"]
    with open(ckpt / info.relative_path, "r+b") as f:  # overwrite the whole archive of 'w' (same length)
        f.seek(info.offset)
        f.write(b"\x00" * info.length)
    with pytest.raises(RecipeError, match="cannot read chunk .* of 'w'") as e:
        src.get("w")
    assert "\n" not in str(e.value)
    assert torch.equal(src.get("h"), tensors()["h"])  # the other tensors are untouched


def test_chunks_that_do_not_cover_a_tensor_are_refused(ckpt):
    meta_file = ckpt / ".metadata"
    meta = pickle.loads(meta_file.read_bytes())
    key = next(k for k in meta.storage_data if k.fqn == "model.w")
    del meta.storage_data[key]
    meta_file.write_bytes(pickle.dumps(meta))
    with pytest.raises(RecipeError, match="chunks of 'model.w'.*cover 0 of its 24 elements") as e:
        dcpio.DCPSource(ckpt)
    assert "\n" not in str(e.value)


def test_large_tensors_are_hashed_while_written(tmp_path):
    """The stream writer hashes buffers of 4 MB and more on a second thread while writing them: the manifest's
    digest must still be the file's."""
    import hashlib

    from safetensors.torch import load_file

    from sftrecipes.export import SafetensorsStreamWriter

    big, small = torch.randn(1024, 1536), torch.arange(10)  # 6 MB: the threaded path; 80 B: the plain one
    w = SafetensorsStreamWriter(tmp_path / "m.safetensors", [("big", big.dtype, tuple(big.shape)), ("small", small.dtype, (10,))])
    w.write("big", big)
    w.write("small", small)
    w.close()
    assert w.sha256.hexdigest() == hashlib.sha256((tmp_path / "m.safetensors").read_bytes()).hexdigest()
    got = load_file(tmp_path / "m.safetensors")
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)
