"""kvstride.identity.checkpoint_digest: what it detects in a checkpoint and what it cannot.

Checkpoints are written here in the safetensors format (an 8-byte header length, the JSON
header, the tensors' bytes), tensor by tensor with numpy, so each test controls every byte."""

import json
import shutil
import struct

import numpy as np
import pytest

from kvstride.identity import FILE_WINDOWS, WINDOW_BYTES, WINDOWS, checkpoint_digest, checkpoint_files

BIG = (256, 1024)  # 512 KiB of bf16: far more than the sampled windows
SMALL = (1024,)  # 2 KiB: hashed whole


def write_safetensors(path, tensors: dict, dtype: str = "BF16") -> None:
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, array in tensors.items():
        raw = array.astype(np.uint16).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def weights(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model.layers.0.self_attn.k_proj.weight": rng.integers(0, 1 << 16, BIG),
        "model.layers.0.input_layernorm.weight": rng.integers(0, 1 << 16, SMALL),
        "lm_head.weight": rng.integers(0, 1 << 16, BIG),
    }


def make_checkpoint(path, tensors=None, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    write_safetensors(path / "model.safetensors", tensors if tensors is not None else weights())
    return path


def digest(path):
    return checkpoint_digest(path).digest


@pytest.fixture
def base(tmp_path):
    return make_checkpoint(tmp_path / "base")


def test_same_bytes_same_digest_wherever_they_are(base, tmp_path):
    copy = shutil.copytree(base, tmp_path / "elsewhere")
    assert digest(copy) == digest(base)


def test_a_fine_tune_of_one_tensor_is_detected(base, tmp_path):
    """Every element of one matrix moved (a full fine-tune, a merged LoRA): another digest."""
    tuned = weights()
    tuned["model.layers.0.self_attn.k_proj.weight"] = tuned["model.layers.0.self_attn.k_proj.weight"] ^ 1
    assert digest(make_checkpoint(tmp_path / "tuned", tuned)) != digest(base)


def test_any_change_to_a_small_tensor_is_detected(base, tmp_path):
    tuned = weights()
    tuned["model.layers.0.input_layernorm.weight"][517] ^= 1  # one bit of a norm
    assert digest(make_checkpoint(tmp_path / "tuned", tuned)) != digest(base)


def test_first_and_last_bytes_of_a_large_tensor_are_sampled(base, tmp_path):
    for index in ((0, 0), (-1, -1)):
        tuned = weights()
        tuned["lm_head.weight"][index] ^= 1
        assert digest(make_checkpoint(tmp_path / f"tuned{index[0]}", tuned)) != digest(base)


def test_a_change_between_the_windows_is_not_seen(base, tmp_path):
    """The documented limit: one weight changed between the sampled windows of a large tensor
    leaves the digest alone (``model_identity`` covers that case)."""
    tuned = weights()
    tuned["lm_head.weight"][40, 7] ^= 1  # byte 81934: past the first 4 KiB, before a third of 512 KiB
    assert digest(make_checkpoint(tmp_path / "tuned", tuned)) == digest(base)


def test_header_fields_are_covered(base, tmp_path):
    """The same bytes under another dtype name, or another tensor name: another digest."""
    other_dtype = tmp_path / "f16"
    make_checkpoint(other_dtype)
    write_safetensors(other_dtype / "model.safetensors", weights(), dtype="F16")
    renamed = {k.replace("layers.0", "layers.1"): v for k, v in weights().items()}
    assert len({digest(base), digest(other_dtype), digest(make_checkpoint(tmp_path / "renamed", renamed))}) == 3


def test_config_is_covered_and_the_tokenizer_is_not(base, tmp_path):
    rope = make_checkpoint(tmp_path / "rope", config={"architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
                                                       "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert digest(rope) != digest(base)
    retokenized = shutil.copytree(base, tmp_path / "retokenized")
    (retokenized / "tokenizer.json").write_text("{}")
    assert digest(retokenized) == digest(base)


def test_reads_a_bounded_sample(tmp_path):
    """Bytes read: the headers, the configs and at most WINDOWS windows per tensor, however
    large the tensors are."""
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.integers(0, 1 << 16, (512, 1024)) for i in range(4)}  # 1 MiB each
    path = make_checkpoint(tmp_path / "big", tensors)
    result = checkpoint_digest(path)
    assert result.tensors == 4 and result.files == 2
    header = (path / "model.safetensors").stat().st_size - 4 * (1 << 20)
    assert result.bytes_read <= header + (path / "config.json").stat().st_size + 4 * WINDOWS * WINDOW_BYTES


def test_other_weight_formats_are_sampled(tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text("{}")
    blob = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    (path / "pytorch_model.bin").write_bytes(blob.tobytes())
    before = checkpoint_digest(path)
    assert before.bytes_read <= 2 + FILE_WINDOWS * WINDOW_BYTES
    blob[-1] ^= 1
    (path / "pytorch_model.bin").write_bytes(blob.tobytes())
    assert checkpoint_digest(path).digest != before.digest


def test_safetensors_preferred_over_other_formats(base):
    (base / "pytorch_model.bin").write_bytes(b"\0" * 100)
    assert [p.name for p in checkpoint_files(base)] == ["config.json", "model.safetensors"]


def test_bad_checkpoints_are_value_errors_naming_the_file(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no"):
        checkpoint_digest(empty)
    assert checkpoint_digest(empty, weights=False).files == 1
    broken = make_checkpoint(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="model.safetensors.*not a safetensors file"):
        checkpoint_digest(broken)
    with pytest.raises(ValueError, match="neither a folder nor a file"):
        checkpoint_digest(tmp_path / "missing")


def test_many_tensors_get_fewer_windows_each_but_at_least_the_first(tmp_path, monkeypatch):
    """Past MAX_SAMPLED_WINDOWS / WINDOWS tensors (MoE experts), one window a tensor: its first
    bytes, which any fine-tune of that tensor changes."""
    import kvstride.identity as identity

    monkeypatch.setattr(identity, "MAX_SAMPLED_WINDOWS", 4)
    tensors = weights()
    base = checkpoint_digest(make_checkpoint(tmp_path / "base", tensors))
    assert base.bytes_read < (tmp_path / "base" / "model.safetensors").stat().st_size // 8
    tensors["lm_head.weight"][0, 0] ^= 1
    assert checkpoint_digest(make_checkpoint(tmp_path / "tuned", tensors)).digest != base.digest
