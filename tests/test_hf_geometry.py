"""``kvstride explain --model`` and the trace replay read the model a user serves: its
checkpoint folder, its ``config.json``, or a repository id in the local Hugging Face cache
(``kvstride.hf_geometry``), deriving what the shipped geometries were derived with vLLM's own
classes (``scripts/derive_model_geometry.py``)."""

from __future__ import annotations

import json

import pytest

from kvstride import cli
from kvstride.trace import load_model

# google/gemma-3-27b-it's text config, as published (the fields the geometry reads).
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "text_config": {"num_hidden_layers": 62, "sliding_window": 1024, "sliding_window_pattern": 6,
                    "num_key_value_heads": 16, "num_attention_heads": 32, "head_dim": 128, "hidden_size": 5376},
    "torch_dtype": "bfloat16",
}


def _checkpoint(tmp_path, config: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _groups(model):
    return [(g.kind, g.block_size, getattr(g, "window", None)) for g in model.groups], list(model.bytes_per_block)


@pytest.mark.parametrize("form", ["folder", "config.json"])
def test_a_checkpoint_gives_the_geometry_vllm_runs_it_with(tmp_path, form):
    """Gemma-3-27B's config gives the geometry shipped for it (derived there with vLLM's own
    KV-cache specs): 10 full-attention and 52 sliding-window layers, 16-token blocks."""
    folder = _checkpoint(tmp_path, GEMMA3_27B)
    model = load_model(str(folder if form == "folder" else folder / "config.json"))
    assert _groups(model) == _groups(load_model("gemma-3-27b"))
    assert model.layers == load_model("gemma-3-27b").layers


def test_layer_types_mla_and_dense_models(tmp_path):
    gpt_oss = _checkpoint(tmp_path, {
        "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 128,
        "num_key_value_heads": 8, "num_attention_heads": 64, "head_dim": 64, "hidden_size": 2880,
        "torch_dtype": "bfloat16"}, "gpt-oss")
    groups, sizes = _groups(load_model(str(gpt_oss)))
    assert groups == [("full_attention", 16, None), ("sliding_window", 16, 128)]
    assert sizes == [2 * (16 * 2 * 8 * 64 * 2)] * 2
    llama = _checkpoint(tmp_path, {"num_hidden_layers": 32, "num_key_value_heads": 8, "num_attention_heads": 32,
                                   "hidden_size": 4096, "torch_dtype": "bfloat16"}, "llama")
    assert _groups(load_model(str(llama))) == ([("full_attention", 16, None)], [32 * 16 * 2 * 8 * 128 * 2])
    deepseek = _checkpoint(tmp_path, {"num_hidden_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                      "num_attention_heads": 16, "hidden_size": 2048, "torch_dtype": "bfloat16"}, "mla")
    assert _groups(load_model(str(deepseek))) == ([("mla", 16, None)], [3 * 16 * (512 + 64) * 2])


def test_a_model_with_state_layers_is_refused_naming_what_works(tmp_path, capsys):
    qwen3_next = _checkpoint(tmp_path, {"num_hidden_layers": 4, "num_key_value_heads": 2, "num_attention_heads": 16,
                                        "head_dim": 256, "hidden_size": 2048, "torch_dtype": "bfloat16",
                                        "layer_types": ["linear_attention"] * 3 + ["full_attention"]}, "qwen3-next")
    with pytest.raises(SystemExit) as done:
        cli.main(["explain", "--model", str(qwen3_next)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "linear_attention" in err and "qwen3-next-80b" in err and len(err.strip().splitlines()) == 1


def test_a_repository_id_in_the_local_cache(tmp_path, monkeypatch):
    """``--model google/gemma-3-27b-it`` where vLLM downloaded it: the Hugging Face cache's
    snapshot (never the network)."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    repo = cache / "models--google--gemma-3-27b-it"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(GEMMA3_27B))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert _groups(load_model("google/gemma-3-27b-it")) == _groups(load_model("gemma-3-27b"))


def test_explain_reads_a_checkpoint(tmp_path, capsys):
    folder = _checkpoint(tmp_path, GEMMA3_27B, "gemma")
    assert cli.main(["explain", "--model", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "sliding_window" in out and "full_attention" in out
