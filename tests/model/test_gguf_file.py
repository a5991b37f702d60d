"""The struct-based GGUF reader against the `gguf` package's own reader (the oracle): metadata, tensor index, bytes."""

import numpy as np
import pytest

from specjax.model.gguf_file import GGUFFile


def lib_fields(reader) -> dict:
    import gguf

    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.STRING:
            out[key] = bytes(f.parts[f.data[0]]).decode("utf-8")
        elif kind == gguf.GGUFValueType.ARRAY:
            if f.types[1] == gguf.GGUFValueType.STRING:
                out[key] = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                out[key] = [f.parts[i][0].item() for i in f.data]
        else:
            out[key] = f.parts[-1][0].item()
    return out


def assert_same_as_lib(path: str) -> None:
    import gguf

    ours, lib = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.fields == lib_fields(lib)
    assert [t.name for t in ours.tensors] == [t.name for t in lib.tensors]
    for a, b in zip(ours.tensors, lib.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data), err_msg=a.name)


def write_varied(path: str) -> None:
    """Every metadata type the loader may meet, plus plain and quantized tensors with odd shapes."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 600)
    w.add_int16("t.i16", -600)
    w.add_uint32("t.u32", 70000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2 ** 40)
    w.add_int64("t.i64", -(2 ** 40))
    w.add_float64("t.f64", 1e-300)
    w.add_string("t.str", "héllo ▁world")
    w.add_array("t.strs", ["a", "", "ü b", "<|im_end|>"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.25, -1.5])
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((4,)).astype(np.float16))
    q = rng.standard_normal((2, 64)).astype(np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("q8", gguf.quants.quantize(q, q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_matches_the_gguf_package_on_every_metadata_type(tmp_path):
    path = str(tmp_path / "varied.gguf")
    write_varied(path)
    assert_same_as_lib(path)
    f = GGUFFile(path)
    assert f.fields["t.strs"] == ["a", "", "ü b", "<|im_end|>"] and f.fields["t.i64"] == -(2 ** 40)


def test_matches_the_gguf_package_on_the_default_model(smollm_path):
    assert_same_as_lib(smollm_path)


@pytest.mark.parametrize("cut", [3, 24, 200, -100])
def test_truncated_or_foreign_files_raise_value_errors(tmp_path, cut):
    path = str(tmp_path / "varied.gguf")
    write_varied(path)
    data = open(path, "rb").read()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:cut])  # -100: inside the last tensor (q8, 136 bytes)
    with pytest.raises(ValueError, match="GGUF|truncated"):
        GGUFFile(str(bad))


def test_load_error_names_the_file(tmp_path):
    from specjax.model.loader import CheckpointError, load_model

    bad = tmp_path / "notgguf.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="notgguf.gguf.*bad magic"):
        load_model(str(bad))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16", "F32"])
def test_dequantize_matches_the_gguf_package_bit_for_bit(kind):
    """Random bytes in every block (scales included, NaN and inf among them): the same float32 values."""
    import gguf

    from specjax.model.gguf_file import BLOCK_DEQUANT, dequantize

    kind_enum = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(0)
    if kind in BLOCK_DEQUANT:
        data = rng.integers(0, 256, size=(7, 3 * BLOCK_DEQUANT[kind][0]), dtype=np.uint8)
    else:
        data = rng.standard_normal((7, 96)).astype(np.float16 if kind == "F16" else np.float32)
    ours, theirs = dequantize(data, kind_enum), np.asarray(gguf.quants.dequantize(data, kind_enum), np.float32)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (7, 96)
    np.testing.assert_array_equal(ours, theirs)


def test_dequantize_matches_on_the_default_model(smollm_path):
    import gguf

    from specjax.model.gguf_file import GGUFFile, dequantize

    kinds = {}
    for t in GGUFFile(smollm_path).tensors:
        kinds.setdefault(t.tensor_type.name, t)
    assert {"Q4_1", "Q8_0"} <= set(kinds)
    for t in kinds.values():
        np.testing.assert_array_equal(dequantize(t.data, t.tensor_type),
                                      np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
